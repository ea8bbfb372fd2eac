"""kiln.native sits low: it imports only the standard library, ctypes/numpy and kiln's foundation (errors,
fileio), so any layer may use it and it never pulls torch or the tactics in."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import kiln.native

ALLOWED_KILN = {"kiln.errors", "kiln.fileio"}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_native_imports_only_the_standard_library_ctypes_and_kiln_foundation():
    bad = []
    for path in sorted(Path(kiln.native.__file__).parent.rglob("*.py")):
        for module in imports_of(path):
            top = module.split(".")[0]
            if module.startswith("kiln.native") or module in ALLOWED_KILN or top == "numpy":
                continue
            if top == "kiln" or top not in sys.stdlib_module_names:
                bad.append(f"{path.name}: {module}")
    assert not bad, bad
