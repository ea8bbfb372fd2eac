"""Self-checks of kernels in a child process, for kernels that may never have run on this kind of CPU (kiln's AMX
kernels): one that faults there (SIGILL, SIGSEGV), hangs or disagrees costs a warning and its tactics, never the
build or server that asked. The verdict is cached beside the kernel library it checked, whose cache key covers
its source, compiler, flags and this CPU, so the child runs once per library build.

The child is `python -m MODULE`, a module whose `__main__` block runs its check and prints the verdict with
`report` (kiln.tactics.gemm_amx, qgemm_amx): nothing is imported by a name read at run time."""
from __future__ import annotations

import hashlib
import json
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kiln.fileio import atomic_write_text
from kiln.native import state

log = logging.getLogger("kiln.native")
TIMEOUT_S = 300   # a cold child imports torch and may compile the library: tens of seconds at worst
VERDICT_FORMAT = "kiln-selfcheck-verdict-1"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    detail: str   # what the check measured, or why it failed


def verdict_path(library: Path, module: str) -> Path:
    """Where `module`'s verdict on `library` is cached: beside it, named after both."""
    return library.parent / f"{library.name}.selfcheck-{hashlib.sha256(module.encode()).hexdigest()[:12]}.json"


def verdict(library: str, module: str) -> Verdict:
    """The self-check `python -m module` run in a child process for kernel library `library` (a name in
    kiln.native.catalog), or its cached verdict."""
    path = verdict_path(state(library).path, module)
    cached = read_verdict(path, module)
    if cached is not None:
        return cached
    found = run_child(module)
    if "did not finish" not in found.detail:   # a slow machine may do better next time: not cached
        atomic_write_text(path, json.dumps({"format": VERDICT_FORMAT, "check": module, "passed": found.passed,
                                            "detail": found.detail}))
    return found


def read_verdict(path: Path, module: str) -> Verdict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != VERDICT_FORMAT or data.get("check") != module or \
            not isinstance(data.get("passed"), bool) or not isinstance(data.get("detail"), str):
        return None
    return Verdict(data["passed"], data["detail"])


def run_child(module: str, args: tuple[str, ...] = (), timeout_s: float = TIMEOUT_S) -> Verdict:
    """Runs `python -m module args...`; a signal, a timeout or no verdict on its last line of output is a failure."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"the self-check process did not finish in {timeout_s:g} s")
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else \
            f"signal {-proc.returncode}"
        return Verdict(False, f"the self-check process was killed by {name}")
    lines = proc.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
        return Verdict(bool(data["passed"]), str(data["detail"]))
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Verdict(False, f"the self-check process exited with status {proc.returncode} without a verdict "
                              f"({tail})")


def report(passed: bool, detail: str) -> None:
    """What a check module's `__main__` block ends with: the verdict, on the last line of its output."""
    print(json.dumps({"passed": bool(passed), "detail": str(detail)}), flush=True)
