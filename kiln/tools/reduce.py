"""Delta debugging of an ONNX model (Polygraphy's `debug reduce`): the smallest subgraph for which a check command
still fails. Bisect from the outputs (the earliest node whose outputs, made graph outputs, still fail), then from
the inputs (the latest node from which on the graph still fails, the tensors it cuts made graph inputs), then
remove single nodes while the check keeps failing. A cut tensor gets its dtype and shape from ONNX shape
inference, else from running onnxruntime on the whole model. Constant subgraphs (initializers, Constant nodes and
what only they feed) come along with the nodes that need them and are never cut."""
from __future__ import annotations

import logging
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from kiln.errors import ModelError

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class Check:
    """A command run on each candidate model; it fails when it exits non-zero (and, with `fail_regex`, when its
    output matches too). `{model}` in the command is replaced by the candidate's path."""
    command: str
    shell: bool = False
    fail_regex: str | None = None
    timeout_s: float | None = None

    def argv(self, model_path: str) -> list[str] | str:
        if self.shell:
            return self.command.replace("{model}", shlex.quote(model_path))
        return [arg.replace("{model}", model_path) for arg in shlex.split(self.command)]

    def fails(self, model_path: str) -> bool:
        try:
            done = subprocess.run(self.argv(model_path), shell=self.shell, capture_output=True, text=True,
                                  timeout=self.timeout_s, errors="replace")
        except subprocess.TimeoutExpired:
            log.info("check timed out after %s s: counted as a failure", self.timeout_s)
            return self.fail_regex is None
        except OSError as exc:
            raise ModelError(f"the check command cannot be started ({exc}): {self.command}") from None
        if done.returncode == 0:
            return False
        return self.fail_regex is None or re.search(self.fail_regex, done.stdout + done.stderr) is not None


@dataclass(frozen=True)
class ReduceResult:
    model: onnx.ModelProto
    nodes: tuple[str, ...]             # "name (OpType)" of every node left, in graph order
    original_node_count: int
    checks_run: int


def node_label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name or f'<unnamed #{index}>'} ({node.op_type})"


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph (If/Loop/Scan body) reads from the enclosing scope."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {o for n in graph.node for o in n.output}
    return {name for n in graph.node for name in _reads(n)} - defined


def _reads(node: onnx.NodeProto) -> list[str]:
    names = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            names += sorted(_subgraph_reads(sub))
    return names


def _complete(vi: onnx.ValueInfoProto | None) -> bool:
    t = vi.type.tensor_type if vi is not None and vi.type.HasField("tensor_type") else None
    return t is not None and t.elem_type != 0 and t.HasField("shape") and \
        all(d.HasField("dim_value") for d in t.shape.dim)


class ModelGraph:
    """The model's nodes, who produces and reads each tensor, which nodes are constant, and tensor metadata."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.nodes = list(g.node)
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = {vi.name: vi for vi in g.input if vi.name not in self.initializers}
        self.graph_outputs = {vi.name: vi for vi in g.output}
        self.reads = [_reads(n) for n in self.nodes]
        self.producer = {o: i for i, n in enumerate(self.nodes) for o in n.output if o}
        self.used = {name for r in self.reads for name in r} | set(self.graph_outputs)
        constant: set[str] = set(self.initializers)
        self.constant_nodes: set[int] = set()
        for i, node in enumerate(self.nodes):
            if all(name in constant for name in self.reads[i]):
                self.constant_nodes.add(i)
                constant.update(o for o in node.output if o)
        self.variable_nodes = [i for i in range(len(self.nodes)) if i not in self.constant_nodes]
        self.metadata = self._inferred_metadata()
        self._fallback: dict[str, onnx.ValueInfoProto] | None = None

    def _inferred_metadata(self) -> dict[str, onnx.ValueInfoProto]:
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, data_prop=True).graph
        except Exception as exc:                      # noqa: BLE001 - any inference failure: fall back to onnxruntime
            log.info("ONNX shape inference failed (%s): shapes come from onnxruntime", exc)
            inferred = self.model.graph
        return {vi.name: vi for vi in list(inferred.value_info) + list(inferred.output) + list(inferred.input)}

    def value_info(self, name: str) -> onnx.ValueInfoProto:
        """dtype and shape of a tensor that becomes a graph input or output."""
        for known in (self.graph_inputs, self.graph_outputs):
            if name in known:
                return known[name]
        if _complete(self.metadata.get(name)):
            return self.metadata[name]
        if self._fallback is None:
            self._fallback = self._run_fallback()
        if name in self._fallback:
            return self._fallback[name]
        vi = self.metadata.get(name)
        if vi is not None and vi.type.tensor_type.elem_type:
            return vi
        raise ModelError(f"tensor '{name}': neither ONNX shape inference nor onnxruntime gives its type, so it "
                         "cannot become a graph input or output of a reduced model; fix the shapes first (e.g. "
                         "make the input shapes static)")

    def _run_fallback(self) -> dict[str, onnx.ValueInfoProto]:
        from kiln.optional import available, require

        if not available("onnxruntime"):
            return {}
        ort = require("onnxruntime", "kiln debug reduce's shape fallback")
        names = [o for i in self.variable_nodes for o in self.nodes[i].output if o]
        probe = onnx.ModelProto()
        probe.CopyFrom(self.model)
        del probe.graph.output[:]
        probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(names))
        try:
            session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            values = session.run(None, _sample_inputs(self.graph_inputs.values()))
        except Exception as exc:                      # noqa: BLE001 - onnxruntime's own error types
            log.info("onnxruntime cannot run the model for shapes (%s)", str(exc).splitlines()[0])
            return {}
        return {n: helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                for n, v in zip(dict.fromkeys(names), values)}


def _sample_inputs(inputs) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in inputs:
        t = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in t.shape.dim]
        feeds[vi.name] = rng.random(shape).astype(dtype) if np.issubdtype(dtype, np.floating) \
            else np.zeros(shape, dtype)
    return feeds


def included_nodes(mg: ModelGraph, kept: frozenset[int]) -> list[int]:
    """The variable nodes `kept` plus the constant nodes they need, in graph order."""
    order = set(kept)
    pending = [name for i in kept for name in mg.reads[i]]
    while pending:
        producer = mg.producer.get(pending.pop())
        if producer is not None and producer in mg.constant_nodes and producer not in order:
            order.add(producer)
            pending += mg.reads[producer]
    return sorted(order)


def subgraph(mg: ModelGraph, kept: frozenset[int]) -> onnx.ModelProto:
    """The model of the variable nodes `kept` plus the constant nodes they need: tensors they read that no kept
    node writes become graph inputs, tensors they write that no kept node reads (and the model used) outputs."""
    included = included_nodes(mg, kept)
    written = {o for i in included for o in mg.nodes[i].output if o}
    read = [name for i in included for name in mg.reads[i]]
    inputs = [n for n in dict.fromkeys(read) if n not in written and n not in mg.initializers]
    outputs = [o for i in included if i in kept for o in mg.nodes[i].output
               if o and o in mg.used and (o not in read or o in mg.graph_outputs)]
    graph = helper.make_graph([mg.nodes[i] for i in included], mg.model.graph.name or "reduced",
                              [mg.value_info(n) for n in inputs], [mg.value_info(n) for n in outputs],
                              [mg.initializers[n] for n in dict.fromkeys(read) if n in mg.initializers])
    model = helper.make_model(graph, opset_imports=mg.model.opset_import, ir_version=mg.model.ir_version,
                              producer_name="kiln debug reduce")
    model.functions.extend(mg.model.functions)
    return model


class _Search:
    """Runs the check on candidate node sets, each set once."""

    def __init__(self, mg: ModelGraph, check: Check, folder: Path):
        self.mg, self.check, self.path = mg, check, str(folder / "candidate.onnx")
        self.seen: dict[frozenset[int], bool] = {}

    def fails(self, kept: frozenset[int]) -> bool:
        if not kept:
            return False
        if kept not in self.seen:
            onnx.save(subgraph(self.mg, kept), self.path)
            self.seen[kept] = self.check.fails(self.path)
            log.info("check %d: %d nodes -> %s", len(self.seen), len(kept), "fails" if self.seen[kept] else "passes")
        return self.seen[kept]


def _ancestors(mg: ModelGraph, node: int) -> frozenset[int]:
    found, pending = {node}, list(mg.reads[node])
    while pending:
        producer = mg.producer.get(pending.pop())
        if producer is not None and producer not in mg.constant_nodes and producer not in found:
            found.add(producer)
            pending += mg.reads[producer]
    return frozenset(found)


def _first_failing(count: int, fails: Callable[[int], bool]) -> int:
    """The smallest i in [0, count) for which fails(i), assuming every i above it fails too; count if none."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _reduce_outputs(search: _Search, kept: frozenset[int]) -> frozenset[int]:
    order = sorted(kept)
    i = _first_failing(len(order), lambda k: search.fails(_ancestors(search.mg, order[k]) & kept))
    return kept if i == len(order) else _ancestors(search.mg, order[i]) & kept


def _reduce_inputs(search: _Search, kept: frozenset[int]) -> frozenset[int]:
    order = sorted(kept)
    # the latest start that still fails: search the reversed starts for the first failing one
    k = _first_failing(len(order), lambda r: search.fails(frozenset(order[len(order) - 1 - r:])))
    return kept if k == len(order) else frozenset(order[len(order) - 1 - k:])


def _remove_one_by_one(search: _Search, kept: frozenset[int]) -> frozenset[int]:
    changed = True
    while changed and len(kept) > 1:
        changed = False
        for node in sorted(kept, reverse=True):
            smaller = kept - {node}
            if len(kept) > 1 and search.fails(smaller):
                kept, changed = smaller, True
    return kept


def reduce_model(model_path: str | Path, check: Check) -> ReduceResult:
    """The smallest subgraph of the model at `model_path` for which `check` still fails."""
    from kiln.frontend import load_model

    mg = ModelGraph(load_model(model_path))
    everything = frozenset(mg.variable_nodes)
    with tempfile.TemporaryDirectory(prefix="kiln-reduce-") as folder:
        search = _Search(mg, check, Path(folder))
        onnx.save(mg.model, search.path)
        if not check.fails(search.path):
            raise ModelError(f"the check passes on {model_path}: nothing to reduce")
        search.seen[everything] = True
        kept = _reduce_outputs(search, everything)
        kept = _reduce_inputs(search, kept)
        kept = _remove_one_by_one(search, kept)
        checks = len(search.seen)
    reduced = subgraph(mg, kept)
    labels = tuple(node_label(mg.nodes[i], i) for i in included_nodes(mg, kept))
    return ReduceResult(reduced, labels, len(mg.nodes), checks)
