"""An interrupted build (SIGINT or SIGTERM) leaves the previous engine intact and no temporary files behind."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_build_keeps_previous_engine(tmp_path, sig):
    from tests.reliability.test_concurrency import cnn

    model = tmp_path / "m.onnx"
    model.write_bytes(cnn().SerializeToString())
    engine = tmp_path / "m.kiln"
    engine.write_bytes(b"previous engine")
    # -u: the log reaches the pipe line by line (block-buffered, "Timing Runner" could arrive only at the end)
    cmd = [sys.executable, "-u", "-m", "kiln.cli.main", "build", str(model), "-o", str(engine), "--verbose",
           "--avg-timing", "50", "--min-timing", "20"]   # slow timing: the signal lands mid-build
    # Ctrl-C as in a terminal: a test worker may have left SIGINT ignored, and a child inherits that disposition
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    for line in proc.stdout:   # wait until tactic timing has started
        if "Timing Runner" in line or time.time() > deadline:
            break
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-2000:]
    assert engine.read_bytes() == b"previous engine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kiln", "m.onnx"]
    assert "interrupted; no output file was changed" in out
