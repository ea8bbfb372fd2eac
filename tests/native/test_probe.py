"""The toolchain probe runs on first use, never at import, and compiles only once per cache: a later process
finds the verified probe library and only asks the compiler for its version."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def logging_compiler(folder: Path, real: str) -> tuple[Path, Path]:
    """A $CC that appends its arguments to a log, then runs the real compiler."""
    log, wrapper = folder / "cc.log", folder / "cc"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def run_python(code: str, cache: Path, cc: Path) -> str:
    env = {**os.environ, "KILN_CACHE_DIR": str(cache), "CC": str(cc),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def compiles(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if " -o " in f" {line} "] if log.exists() else []


def test_probe_is_lazy_and_compiled_once_per_cache(compiler, tmp_path):
    cc, log = logging_compiler(tmp_path, compiler.compiler)
    cache = tmp_path / "cache"
    run_python("import kiln, kiln.native, kiln.tactics, kiln.cli.main", cache, cc)
    assert not log.exists(), f"importing kiln ran the compiler: {log.read_text()}"

    assert run_python("from kiln import native; print(native.available())", cache, cc).strip() == "True"
    assert len(compiles(log)) == 1 and "probe" in compiles(log)[0]   # the first process builds the probe

    log.unlink()
    assert run_python("from kiln import native; print(native.available())", cache, cc).strip() == "True"
    assert log.read_text().split() == ["--version"]   # a later one only asks for the version
