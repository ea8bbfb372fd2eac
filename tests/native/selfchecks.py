"""A self-check module for tests/native/test_selfcheck.py: `python -m tests.native.selfchecks BEHAVIOUR`."""
from __future__ import annotations

import ctypes
import sys
import time

from kiln.native import selfcheck

if __name__ == "__main__":
    behaviour = sys.argv[1]
    if behaviour == "faults":
        ctypes.string_at(0)   # reads address 0: SIGSEGV, as a kernel faulting on an instruction would
    if behaviour == "hangs":
        time.sleep(60)
    if behaviour == "raises":
        raise RuntimeError("no AMX here")
    selfcheck.report(behaviour == "passes", "max difference 0" if behaviour == "passes" else "max difference 3")
