"""The IR: values and nodes with explicit users, a printable, verifiable graph (torch.fx style)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.errors import ModelError


@dataclass(eq=False)
class Value:
    """A tensor edge. `const` holds data for initializers and folded constants. `shape` is the shape at the
    optimization profile's opt point; `dyn_dims` lists the axes that vary with the input shapes; `probe_shape` is
    the shape at a second point of the profiles, where every dynamic input axis differs (None: not known)."""

    name: str
    shape: tuple[int, ...] | None = None
    dyn_dims: tuple[int, ...] = ()
    probe_shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    const: np.ndarray | None = None
    producer: "Node | None" = None
    users: list["Node"] = field(default_factory=list)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(eq=False)
class Node:
    """An operation. `origin` lists the ONNX node names this node stands for (several after fusion)."""

    name: str
    op_type: str
    inputs: list[Value | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    origin: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op_type})"


def same_extent(a: Value, i: int, b: Value, j: int) -> bool:
    """Whether axis i of `a` and axis j of `b` have one size at every input shape, as far as the opt and probe
    points tell: equal at both, both static or both dynamic. Two dynamic axes with a probe size not known are not
    taken as one (equal sizes at the opt point can be a coincidence: [B*S] and [B] at S = 1)."""
    if a.shape is None or b.shape is None or a.shape[i] != b.shape[j] or (i in a.dyn_dims) != (j in b.dyn_dims):
        return False
    if i not in a.dyn_dims:
        return True
    return a.probe_shape is not None and b.probe_shape is not None and a.probe_shape[i] == b.probe_shape[j]


def same_shape(a: Value, b: Value) -> bool:
    """Whether `a` and `b` have one shape at every input shape (see same_extent)."""
    return a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape) and \
        all(same_extent(a, i, b, i) for i in range(len(a.shape)))


def format_shape(shape: tuple[int, ...] | None, dyn_dims: tuple[int, ...] = ()) -> str:
    if shape is None:
        return "?"
    return "x".join("-1" if i in dyn_dims else str(d) for i, d in enumerate(shape)) or "scalar"


def shape_at_points(v: Value) -> str:
    """`v`'s shape at the opt point, with its size at the probe point beside each dynamic axis: "1x16(33)x64"."""
    if v.shape is None:
        return "?"
    probe = v.probe_shape or ()
    return "x".join(f"{d}({probe[i] if i < len(probe) else '?'})" if i in v.dyn_dims else str(d)
                    for i, d in enumerate(v.shape)) or "scalar"


class Graph:
    """An ordered list of nodes (kept topological) plus graph inputs/outputs; edits keep `users` in sync."""

    def __init__(self, name: str = "graph", opset: int = 17):
        self.name = name
        self.opset = opset
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.values: dict[str, Value] = {}
        self.profiles: list = []   # optimization profiles (frontend.profiles.Profile) when inputs are dynamic

    # ---- construction -------------------------------------------------------------------------
    def value(self, name: str) -> Value:
        if name not in self.values:
            self.values[name] = Value(name)
        return self.values[name]

    def fresh_name(self, base: str) -> str:
        name, i = base, 0
        while name in self.values:
            i += 1
            name = f"{base}_{i}"
        return name

    def add_const(self, name: str, data: np.ndarray) -> Value:
        v = self.value(self.fresh_name(name) if name in self.values else name)
        v.const = np.ascontiguousarray(data).reshape(np.shape(data))   # keep 0-d scalars 0-d
        v.shape, v.dtype = tuple(data.shape), data.dtype
        return v

    def add_node(self, node: Node, index: int | None = None) -> Node:
        for v in node.inputs:
            if v is not None:
                v.users.append(node)
        for v in node.outputs:
            v.producer = node
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    # ---- editing --------------------------------------------------------------------------------
    def remove_node(self, node: Node) -> None:
        for v in node.inputs:
            if v is not None and node in v.users:
                v.users.remove(node)
        for v in node.outputs:
            if v.producer is node:
                v.producer = None
        self.nodes.remove(node)

    def set_input(self, node: Node, index: int, value: Value | None) -> None:
        old = node.inputs[index]
        if old is not None and node in old.users:
            old.users.remove(node)
        node.inputs[index] = value
        if value is not None:
            value.users.append(node)

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every user of `old` (and the graph outputs) read `new` instead."""
        for user in list(old.users):
            for i, v in enumerate(user.inputs):
                if v is old:
                    self.set_input(user, i, new)
        if old in self.outputs:
            self.outputs = [new if v is old else v for v in self.outputs]

    def users_of(self, node: Node) -> list[Node]:
        seen: list[Node] = []
        for v in node.outputs:
            for u in v.users:
                if u not in seen:
                    seen.append(u)
        return seen

    def is_output(self, value: Value) -> bool:
        return any(v is value for v in self.outputs)

    def toposort(self) -> None:
        """Re-order nodes topologically, keeping the current order where it is already valid."""
        ready = {id(v) for v in self.values.values() if v.producer is None}
        pending, ordered = list(self.nodes), []
        while pending:
            progressed = False
            rest = []
            for n in pending:
                if all(v is None or id(v) in ready for v in n.inputs):
                    ordered.append(n)
                    ready.update(id(o) for o in n.outputs)
                    progressed = True
                else:
                    rest.append(n)
            if not progressed:
                names = ", ".join(n.name for n in rest[:5])
                raise ModelError(f"graph has a cycle or reads undefined values at nodes: {names}")
            pending = rest
        self.nodes = ordered

    def prune_values(self) -> None:
        """Forget values no node, input or output refers to."""
        live = {id(v) for v in self.inputs + self.outputs}
        for n in self.nodes:
            live.update(id(v) for v in n.inputs if v is not None)
            live.update(id(v) for v in n.outputs)
        self.values = {k: v for k, v in self.values.items() if id(v) in live}

    # ---- checking and printing ------------------------------------------------------------------
    def verify(self) -> None:
        """Fail with an actionable message if the graph is inconsistent."""
        defined = {id(v) for v in self.inputs} | {id(v) for v in self.values.values() if v.is_const}
        for n in self.nodes:
            for v in n.inputs:
                if v is None:
                    continue
                if id(v) not in defined:
                    raise ModelError(f"value '{v.name}' is used before it is defined, at node '{n.name}'")
                if n not in v.users:
                    raise ModelError(f"users list of '{v.name}' misses node '{n.name}'")
            for v in n.outputs:
                if v.producer is not n:
                    raise ModelError(f"value '{v.name}' does not record node '{n.name}' as its producer")
                defined.add(id(v))
        for v in self.outputs:
            if id(v) not in defined:
                raise ModelError(f"graph output '{v.name}' is never produced")

    def __str__(self) -> str:
        """One line per node: `%out: float32[1x4] = domain.Op(%in, const %w) attr=...  # node name`; attributes
        sorted by name, the domain shown only when it is not ONNX's, the dtype only when it is known."""
        lines = [f"graph {self.name}(" + ", ".join(f"%{v.name}: {_typed(v)}" for v in self.inputs) + "):"]
        for n in self.nodes:
            args = ", ".join("None" if v is None else (f"const %{v.name}" if v.is_const else f"%{v.name}")
                             for v in n.inputs)
            outs = ", ".join(f"%{v.name}: {_typed(v)}" for v in n.outputs)
            attrs = "".join(f" {k}={_short(a)}" for k, a in sorted(n.attrs.items()))
            op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
            lines.append(f"  {outs} = {op}({args}){attrs}  # {n.name}")
        lines.append("  return " + ", ".join(f"%{v.name}" for v in self.outputs))
        return "\n".join(lines)


def _typed(v: Value) -> str:
    shape = format_shape(v.shape, v.dyn_dims)
    return shape if v.dtype is None else f"{np.dtype(v.dtype).name}[{shape}]"


def _short(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return f"<array {a.dtype} {list(a.shape)}>"
    if isinstance(a, (list, tuple)) and len(a) > 8:
        return f"[{len(a)} items]"
    return repr(a)

