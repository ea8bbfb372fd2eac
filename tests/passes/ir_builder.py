"""A tiny builder for IR graphs in pass tests, and one helper that runs a single named pass through the manager.

    b = IRBuilder()
    x = b.input("x", (2, 4))
    g = b.graph(b.node("Relu", [b.node("MatMul", [x, b.const("w", np.ones((4, 4)))], "m", (2, 4))], "y", (2, 4)))
    run = run_pass(g, "GemmActFusion", fuse_gemm_activation)
    assert str(g) == expected('''
        graph g(%x: float32[2x4]):
          %y: float32[2x4] = MatMul(%x, const %w) activation={'op': 'Relu', 'attrs': {}}  # m + y
          return %y
        ''')
    assert (run.stat.matches, run.not_fusing) == (1, [])

Output shapes and dtypes are written out by the test (no shape inference runs), so building a graph runs no torch,
and `run_pass` fails a rewrite that calls torch (constant folding excepted).
"""
from __future__ import annotations

import contextlib
import logging
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from torch.overrides import TorchFunctionMode

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import Pass, PassLog, PassStat, run_passes

Shape = tuple[int, ...]


class IRBuilder:
    """Builds a Graph node by node; each node's origin is its own name, as the ONNX importer records it."""

    def __init__(self, name: str = "g"):
        self._g = Graph(name)

    def input(self, name: str, shape: Shape, dtype: Any = np.float32, dyn_dims: tuple[int, ...] = (),
              probe: Shape | None = None) -> Value:
        v = self._new_value(name, shape, dtype, dyn_dims, probe)
        self._g.inputs.append(v)
        return v

    def const(self, name: str, data: Any, dtype: Any = np.float32) -> Value:
        """A constant (initializer) holding `data` as `dtype`."""
        array = np.asarray(data, dtype=dtype)
        if name in self._g.values:
            raise ValueError(f"value '{name}' is already defined")
        return self._g.add_const(name, array)

    def node(self, op_type: str, inputs: list[Value | None], out: str, shape: Shape, *, dtype: Any = None,
             name: str | None = None, domain: str = "", dyn_dims: tuple[int, ...] = (), probe: Shape | None = None,
             **attrs: Any) -> Value:
        """One node with one output `out` of `shape` (dtype: the first input's unless given); named `out` unless
        `name` says otherwise. `probe`: the shape at the importer's probe point (see _new_value)."""
        first = next((v for v in inputs if v is not None), None)
        out_dtype = dtype if dtype is not None else (first.dtype if first is not None else np.float32)
        value = self._new_value(out, shape, out_dtype, dyn_dims, probe)
        self._g.add_node(Node(name or out, op_type, list(inputs), [value], attrs, domain, (name or out,)))
        return value

    def shuffle(self, x: Value, out: str, shape: Shape, steps: list[dict], dyn_dims: tuple[int, ...] = ()) -> Value:
        """A kiln Shuffle layer with its steps ({"reshape": target}, {"transpose": perm})."""
        return self.node("Shuffle", [x], out, shape, domain="kiln", dyn_dims=dyn_dims, steps=steps)

    def multi(self, op_type: str, inputs: list[Value | None], outs: list[tuple[str, Shape]], *, name: str,
              dtype: Any = None, domain: str = "", **attrs: Any) -> list[Value]:
        """One node with several outputs (Split, Dropout with its mask, ...)."""
        out_dtype = dtype if dtype is not None else inputs[0].dtype
        values = [self._new_value(n, s, out_dtype, (), None) for n, s in outs]
        self._g.add_node(Node(name, op_type, list(inputs), values, attrs, domain, (name,)))
        return values

    def graph(self, *outputs: Value) -> Graph:
        """The finished graph returning `outputs`, checked with `verify()`."""
        self._g.outputs = list(outputs)
        self._g.verify()
        return self._g

    def _new_value(self, name: str, shape: Shape, dtype: Any, dyn_dims: tuple[int, ...], probe: Shape | None) -> Value:
        """A value; unless `probe` is given, a dynamic axis's probe size is twice its opt size plus one, so dynamic
        axes of one opt size read as one symbol (give `probe` where they are not)."""
        if name in self._g.values:
            raise ValueError(f"value '{name}' is already defined")
        v = self._g.value(name)
        v.shape, v.dtype, v.dyn_dims = tuple(shape), np.dtype(dtype), tuple(dyn_dims)
        if probe is None and dyn_dims:
            probe = tuple(2 * d + 1 if i in dyn_dims else d for i, d in enumerate(shape))
        v.probe_shape = None if probe is None else tuple(probe)
        return v


@dataclass(frozen=True)
class PassRun:
    """What one pass did: the manager's statistics and the lines it logged on kiln.build (pass-name prefix kept)."""

    stat: PassStat
    lines: tuple[str, ...]

    @property
    def not_fusing(self) -> list[str]:
        return [line for line in self.lines if line.startswith(f"{self.stat.name}: Not fusing ")]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _NoTorchKernels(TorchFunctionMode):
    """Fails a rewrite that calls torch: graph rewrites work on the IR, not on tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise AssertionError(f"the pass ran torch.{getattr(func, '__name__', func)}: only constant folding may")


def run_pass(g: Graph, name: str, rewrite: Callable[[Graph, PassLog], None], folds_constants: bool = False) -> PassRun:
    """Run one named pass through the pass manager (values pruned, the graph verified after it), recording the
    DEBUG lines it logs. Unless it `folds_constants`, any torch call inside it fails the test."""
    logger, handler = logging.getLogger("kiln.build"), _Lines()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    probed = not _unprobed(g)
    try:
        with contextlib.nullcontext() if folds_constants else _NoTorchKernels():
            (stat,) = run_passes(g, [Pass(name, rewrite)], verify_each=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # a value a pass creates carries its probe shape, or later passes read its dynamic axes as unknown
    assert not (probed and _unprobed(g)), f"{name} created dynamic values without a probe shape: {_unprobed(g)}"
    return PassRun(stat, tuple(handler.messages))


def _unprobed(g: Graph) -> list[str]:
    """The dynamic values of `g` with no shape at the probe point."""
    values = [*g.inputs, *(o for n in g.nodes for o in n.outputs)]
    return [v.name for v in values if v.dyn_dims and not v.is_const and v.probe_shape is None]


def run_pass_unchanged(g: Graph, name: str, rewrite: Callable[[Graph, PassLog], None]) -> PassRun:
    """`run_pass` on a graph the pass must leave as it was (every candidate declined, each with its reason)."""
    before = str(g)
    run = run_pass(g, name, rewrite)
    assert str(g) == before, f"{name} changed a graph it should have left alone"
    return run


def expected(text: str) -> str:
    """An expected graph written as an indented triple-quoted block, as `str(graph)` prints it."""
    return textwrap.dedent(text).strip("\n")
