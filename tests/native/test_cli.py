"""`kiln kernels list|warm|verify` on a fresh cache: list shows each library unbuilt, warm builds them all, verify
passes, then fails (exit 1) naming a planted and an altered library, and --remove deletes them. Without a C
compiler list exits 2 with the fix."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln import native

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ["gemm", "qgemm", "layernorm", "attention", "pool", "quant", "resize", "reformat", "rotary", "softmax",
             "conv_planes", "depthwise", "probe", "winograd F(2x2,3x3)", "winograd F(4x4,3x3)"]
if native.buildable("onednn"):   # links oneDNN's C API: listed only where that is installed
    LIBRARIES.append("onednn")


def kiln(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "KILN_CACHE_DIR": str(cache), **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kiln", "kernels", *args], env=full, capture_output=True, text=True,
                          timeout=300)


def table(stdout: str) -> dict[str, list[str]]:
    """list's rows by library label: [key, built, verified, path]."""
    rows = {}
    for line in stdout.splitlines():
        text = line.split("] [I] ", 1)[-1]
        label = next((name for name in LIBRARIES if text.startswith(name + " ")), None)
        if label:
            rows[label] = text[len(label):].split()
    return rows


def test_list_warm_verify(compiler, tmp_path):
    folder = tmp_path / "kernels"
    listed = kiln("list", cache=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = table(listed.stdout)
    assert set(rows) == set(LIBRARIES)
    assert all(row[1] == "no" and row[2] == "-" for name, row in rows.items() if name != "probe")
    assert rows["probe"][1:3] == ["yes", "yes"]   # listing probed the compiler
    assert rows["gemm"][3] == str(folder / f"gemm-{rows['gemm'][0]}.so")

    assert kiln("warm", cache=tmp_path).returncode == 0
    rows = table(kiln("list", cache=tmp_path).stdout)
    assert all(row[1:3] == ["yes", "yes"] and Path(row[3]).is_file() for row in rows.values())
    verified = kiln("verify", cache=tmp_path)
    assert verified.returncode == 0 and f"{len(LIBRARIES)} libraries verified, 0 refused" in verified.stdout

    altered, planted = Path(rows["pool"][3]), folder / "gemm-0123456789abcdef0123456789abcdef.so"
    altered.write_bytes(altered.read_bytes() + b"\0")
    planted.write_bytes(Path(rows["resize"][3]).read_bytes())
    failed = kiln("verify", cache=tmp_path)
    assert failed.returncode == 1
    assert f"REFUSED  {altered}: changed (sha256 " in failed.stdout
    assert f"REFUSED  {planted}: no record" in failed.stdout
    assert f"{len(LIBRARIES) - 1} libraries verified, 2 refused" in failed.stdout
    assert "kiln kernels verify --remove" in failed.stderr
    assert kiln("verify", "--remove", cache=tmp_path).returncode == 1
    assert not altered.exists() and not planted.exists() and not altered.with_suffix(".json").exists()
    assert kiln("verify", cache=tmp_path).returncode == 0


def test_without_a_compiler_list_and_warm_exit_2_with_the_fix(tmp_path):
    for action in ("list", "warm"):
        done = kiln(action, cache=tmp_path, CC="/nonexistent/cc", PATH=str(tmp_path))
        assert done.returncode == 2, done.stderr
        assert "no C compiler that builds kiln's kernels here (cc, or $CC, with OpenMP); install gcc" in done.stderr
