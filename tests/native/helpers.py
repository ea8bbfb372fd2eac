"""Shared by the kernel tests: hide the C compiler from kiln.native, as on a machine without one."""
from __future__ import annotations

from kiln import native
from kiln.native import compiler


def hide_compiler(monkeypatch) -> None:
    """No cc, no $CC, no gcc on PATH for the rest of the test; call native.reset() once it is over."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    native.reset()
