"""benchmarks/compare.py's timing schedule: blocks rotate so no engine always follows the same neighbour, and
each block opens with an untimed inference that absorbs the previous engine's spinning threads."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare  # noqa: E402


def test_blocks_rotate_and_open_with_an_untimed_inference():
    calls = []
    runners = {k: (lambda k=k: calls.append(k)) for k in ("kiln", "onnxruntime", "openvino")}
    samples = compare.time_blocks(runners, rounds=4, runs=2)
    warmup, timed = calls[:3 * compare.WARMUP], calls[3 * compare.WARMUP:]
    assert warmup == [k for k in runners for _ in range(compare.WARMUP)]
    blocks = [timed[i:i + 3] for i in range(0, len(timed), 3)]   # one untimed + two timed calls per block
    assert all(len(set(b)) == 1 for b in blocks)
    order = [b[0] for b in blocks]
    assert order == ["kiln", "onnxruntime", "openvino", "onnxruntime", "openvino", "kiln",
                     "openvino", "kiln", "onnxruntime", "kiln", "onnxruntime", "openvino"]
    assert {k: len(v) for k, v in samples.items()} == {k: 4 * 2 for k in runners}
