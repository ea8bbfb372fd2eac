"""The package's one-way flow, checked on the source: every `import` of every module (top-level or inside a
function) is parsed (AST, nothing is imported) and must point at the same layer or a lower one, and the module
graph must have no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kiln"

# Lowest first: a module may import from its own layer and the layers above it in this list, never below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("kiln.errors", "kiln.fileio", "kiln.version", "kiln.optional", "kiln.hardware")),
    ("plan", ("kiln.plan",)),            # data model, file format, liveness
    ("trt", ("kiln.trt",)),              # TensorRT vocabulary at the edge: names, formats, log lines, JSON
    ("native", ("kiln.native",)),        # the C toolchain and kernel cache
    ("ir", ("kiln.ir",)),
    ("ops", ("kiln.ops",)),
    ("preprocess", ("kiln.preprocess",)),  # ONNX -> ONNX before import (calibration)
    ("frontend", ("kiln.frontend",)),
    ("passes", ("kiln.passes",)),
    ("precision", ("kiln.precision",)),
    ("lowering", ("kiln.tactics",)),
    ("runtime", ("kiln.runtime",)),
    ("planning", ("kiln.planning",)),
    ("builder", ("kiln.builder",)),
    ("api", ("kiln",)),                  # the package itself: build(), load(), Engine
    ("inspect", ("kiln.inspect",)),
    ("tools", ("kiln.tools", "kiln.backend")),
    ("serve", ("kiln.serve",)),          # the inference server (Open Inference Protocol) and its exports
    ("cli", ("kiln.cli", "kiln.demo", "kiln.__main__")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix naming `module`."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports_of(module: str) -> set[str]:
    """The kiln modules `module` imports. `from pkg import name` runs pkg's `__init__` and, where `name` is a
    submodule, that module too: both count (a package whose `__init__` imports its own modules and is imported
    back by one of them is a cycle)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            submodules = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            # the package's own __init__ importing its submodules is no edge; nor is `from kiln import sub`:
            # kiln's __init__ runs before any kiln module anyway, and only submodules are named
            if base != module and not (base == "kiln" and len(submodules) == len(node.names)):
                found.add(base)
            found |= submodules
    return {m for m in found if m == "kiln" or m.startswith("kiln.")}


GRAPH = {m: {i for i in imports_of(m) if i in MODULES} for m in MODULES}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_up_the_layers():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {i} ({LAYERS[layer_of(i)][0]})"
              for m, targets in GRAPH.items() for i in sorted(targets) if layer_of(i) > layer_of(m)]
    assert not upward, "imports against the one-way flow:\n" + "\n".join(upward)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_what_they_look_for():
    """The checker itself: an upward import and a cycle in a made-up graph are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("kiln.plan.model") < layer_of("kiln.tactics.autotune") < layer_of("kiln.cli.main")
    assert layer_of("kiln.builder.build") < layer_of("kiln") < layer_of("kiln.cli")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    """Files stay under 500 lines: a bigger one holds more than one job."""
    lines = MODULES[module].read_text().count("\n")
    assert lines <= 500, f"{MODULES[module]} has {lines} lines; split it by responsibility"
