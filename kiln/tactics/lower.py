"""Lowering: the optimized graph, in order, becomes plan layers. Each node gets a tactic for its granted precision
(timed by the autotuner where there is a choice), Reformat layers go where a tactic wants another layout than
its producer gives, and a Region node (a run of nodes one library runs) becomes one layer with its inner layers."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kiln.ir import Graph, Node, Value
from kiln.ops import lookup
from kiln.plan.model import Arg, Layer, TensorDesc
from kiln.precision.policy import PrecisionDecision, native_precision
from kiln.tactics.autotune import Autotuner
from kiln.tactics.base import ANY, LINEAR, LayerView, Tactic, tactic_value
from kiln.tactics.onnxruntime_source import REGION_TACTIC
from kiln.tactics.openvino_source import OPENVINO_REGION_TACTIC
from kiln.tactics.reformat import NOOP_TACTIC, REFORMAT_TACTIC, is_noop_reformat
from kiln.tactics.registry import candidates, reduced_precisions
from kiln.tactics.storage import NO_GUESS, StorageGuess, store_bf16, writes_bf16
from kiln.trt.vocab import reformat_names, runner_name

CONSTANT_TACTIC = "kiln.constant"
NO_DECISION = PrecisionDecision("", "FP32")   # layers kiln adds (Reformat, Constant, Region) request nothing


def desc_of(v: Value, name: str | None = None, fmt: str = LINEAR) -> TensorDesc:
    return TensorDesc(name or v.name, v.shape, str(v.dtype), fmt, tuple(v.dyn_dims))


def node_view(node: Node, opset: int, with_consts: bool = True) -> LayerView:
    """What a tactic sees of a graph node: shapes, dtypes, attributes and (optionally) its constant inputs."""
    consts = {i: torch.from_numpy(np.array(v.const)) for i, v in enumerate(node.inputs)
              if v is not None and v.is_const} if with_consts else {}
    return LayerView(node.op_type, node.domain, node.attrs, tuple(None if v is None else v.shape for v in node.inputs),
                     tuple(None if v is None else str(v.dtype) for v in node.inputs), consts,
                     tuple(str(v.dtype) for v in node.outputs), opset,
                     tuple(() if v is None else v.dyn_dims for v in node.inputs))


def runtime_shape_inputs(node: Node) -> bool:
    """Whether `node` reads shape arithmetic computed at run time (dynamic shapes): a host input (a shape, axes,
    bounds), a run-time scalar (Range's bounds) or a small integer tensor. Random timing inputs would be meaningless."""
    opdef = lookup(node.op_type, node.domain)
    if opdef is not None and any(i < len(node.inputs) and node.inputs[i] is not None and
                                 not node.inputs[i].is_const for i in opdef.host_inputs):
        return True
    return any(v is not None and not v.is_const and v.shape is not None and v.dtype is not None and
               (v.shape == () or (np.dtype(v.dtype).kind in "iu" and int(np.prod(v.shape)) <= 16))
               for v in node.inputs)


def extra_cost(ms: float) -> str:
    """' + 0.03 ms conversions, reformats and hand-overs' for a precision reason, '' for none."""
    return f" + {ms:.2g} ms conversions, reformats and hand-overs" if ms else ""


def reformat_precision(dtype: str) -> str:
    """A Reformat computes nothing (and requests nothing): one moving INT8 bytes (between INT8 convolutions) is
    granted INT8, not FP32. One moving floats says FP32, bf16 included (store_bf16 decides that later): the accuracy
    budget takes every BF16 layer for a candidate to keep in FP32, and a Reformat, made at lowering, is none."""
    return "INT8" if dtype in ("int8", "uint8") else "FP32"


class Lowering:
    """Walks the optimized graph in order, choosing tactics and inserting Reformat layers between layouts."""

    def __init__(self, g: Graph, sources: frozenset[str] | None, tuner: Autotuner | None = None,
                 precisions: dict[str, PrecisionDecision] | None = None, strict_precision: bool = True,
                 pinned: dict[str, str] | None = None, prefer_source: str | None = None):
        """`strict_precision` (--precision-constraints prefer/obey): a layer granted a reduced precision runs one
        of its kernels; otherwise (TensorRT's default) the precision is allowed, not required, and its kernels
        race the native precision's, the winner deciding the layer's granted precision. `pinned`: node -> the
        tactic an earlier lowering picked (`picked`), kept wherever it is still a candidate (the accuracy budget's
        trials change only the layers they keep in FP32, not the kernels a new timing round would pick).
        `prefer_source`: where a tactic of that source can run a layer, only that source's race (the plan race's
        candidate of kiln's oneDNN primitives wherever they apply)."""
        self.g, self.sources, self.tuner, self.precisions = g, sources, tuner, dict(precisions or {})
        self.strict_precision, self.pinned = strict_precision, dict(pinned or {})
        self.prefer_source = prefer_source
        self.picked: dict[str, str] = {}
        self.timed_ms: dict[str, float] = {}   # node -> its chosen tactic's timed cost (kernel + overhead)
        self.node_layers: dict[str, tuple[int, int]] = {}   # node -> its layers' [start, end) in `layers`
        self.layers: list[Layer] = []
        self.weights: dict[str, np.ndarray] = {}
        self.formats: dict[str, str] = {v.name: LINEAR for v in g.inputs}
        self.descs: dict[str, TensorDesc] = {v.name: desc_of(v) for v in g.inputs}
        self.reformatted: dict[tuple[str, str], str] = {}
        self.position = {id(n): i for i, n in enumerate(g.nodes)}
        self.on_node = None   # progress: called with (nodes done, nodes in all, next node's name) before each node

    def run(self) -> tuple[list[Layer], dict[str, np.ndarray]]:
        for index, node in enumerate(self.g.nodes):
            if self.on_node is not None:
                self.on_node(index, len(self.g.nodes), node.name)
            start = len(self.layers)
            self.lower_node(node)
            self.node_layers[node.name] = (start, len(self.layers))
        self.finish()
        self.layers = store_bf16(self.layers, {v.name for v in self.g.outputs})
        return self.layers, self.weights

    def weight(self, v: Value) -> Arg:
        self.weights.setdefault(v.name, np.ascontiguousarray(v.const).reshape(v.const.shape))
        return Arg("weight", v.name)

    def reformat(self, src: str, target: str, consumer: str, index: int, public_name: str | None = None) -> str:
        """Insert a Reformat layer copying `src` into `target` layout (TensorRT's naming), reused per tensor."""
        if public_name is None and (src, target) in self.reformatted:
            return self.reformatted[(src, target)]
        d = self.descs[src]
        if public_name is None:
            name, new = reformat_names("Input", index, consumer)
            self.reformatted[(src, target)] = new
        else:
            name, new = reformat_names("Output", index, consumer)[0], public_name
        out = dataclasses.replace(d, name=new, format=target)
        tactic = NOOP_TACTIC if is_noop_reformat(d.dims) and not d.dynamic else REFORMAT_TACTIC
        self.layers.append(Layer(name, "Reformat", "kiln", (Arg("tensor", src),), (d,), (out,),
                                 {"origin": "REFORMAT", "target_format": target}, tactic, tactic_value(tactic), "", (),
                                 reformat_precision(d.dtype)))
        self.formats[new], self.descs[new] = target, out
        return new

    def finish(self) -> None:
        """Outputs computed entirely at build time become Constant layers."""
        for v in self.g.outputs:
            if v.is_const:
                self.layers.append(Layer(f"{v.name} [Constant]", "Constant", "kiln", (self.weight(v),), (),
                                         (desc_of(v),), {}, CONSTANT_TACTIC, tactic_value(CONSTANT_TACTIC), "kiln", ()))

    def dying_inputs(self, node: Node) -> frozenset[int]:
        """Indices of `node`'s activation inputs that no later node reads and the graph does not return."""
        here = self.position[id(node)]
        return frozenset(i for i, v in enumerate(node.inputs)
                         if v is not None and not v.is_const and v.producer is not None and not self.g.is_output(v)
                         and all(self.position.get(id(u), -1) <= here for u in v.users)
                         and sum(x is v for x in node.inputs) == 1)

    def decision(self, node: Node) -> PrecisionDecision:
        return self.precisions.get(node.name, NO_DECISION)

    def pick(self, node: Node, view: LayerView) -> Tactic:
        decision, native = self.decision(node), native_precision(node.op_type, view.output_dtypes, view.input_dtypes)
        reduced = None if decision.granted == native else decision.granted
        found = candidates(view, self.sources, reduced)
        if reduced and not self.strict_precision:   # allowed, not required: the native kernels race too
            found += [t for t in candidates(view, self.sources) if t not in found]
        found = [t for t in found if t.source == self.prefer_source] or found
        if self.tuner is None or len(found) == 1 or runtime_shape_inputs(node):
            return found[0]   # shape arithmetic on dynamic axes: random timing inputs would be meaningless
        pinned = next((t for t in found if t.name == self.pinned.get(node.name)), None)
        if pinned is not None:
            return pinned
        have = [None if v is None or v.is_const else self.formats[v.name] for v in node.inputs]
        names = {t.name: runner_name(t.name, t.source, node.op_type) for t in found}
        choice = self.tuner.choose(node.name, view, found, have, names, self.dying_inputs(node), decision.granted,
                                   self.storage_guess(node, decision))
        self.timed_ms[node.name] = choice.kernel_ms + choice.overhead_ms
        if reduced and reduced not in reduced_precisions(choice.tactic):
            fastest = min((t for t in found if reduced in reduced_precisions(t)),
                          key=lambda t: choice.timings_ms[t.name])
            times = choice.timings_ms
            why = f"its {reduced} kernels failed on this CPU (the build log's warnings say how)" \
                if math.isinf(times[fastest.name]) else \
                f"the {native} kernel {choice.tactic.name} timed faster ({times[choice.tactic.name]:.4g} ms" \
                f"{extra_cost(choice.overhead_ms)} against {times[fastest.name]:.4g} ms for {fastest.name})"
            self.precisions[node.name] = PrecisionDecision(decision.requested, native, why)
        return choice.tactic

    def storage_guess(self, node: Node, decision: PrecisionDecision) -> StorageGuess:
        """For a layer granted BF16: its inputs whose producers write bf16, and its output's shape where every
        reader is granted BF16 too (kiln.tactics.storage.StorageGuess)."""
        if decision.granted != "BF16":
            return NO_GUESS
        inputs = frozenset(i for i, v in enumerate(node.inputs) if self.readers_bf16(v) and self.written_bf16(v))
        out = node.outputs[0] if len(node.outputs) == 1 else None
        return StorageGuess(inputs, tuple(out.shape) if self.readers_bf16(out) and out.shape is not None else None)

    def readers_bf16(self, v: Value | None) -> bool:
        """Whether every reader of activation `v` is granted BF16 (so far) and the graph does not return it."""
        return v is not None and not v.is_const and str(v.dtype) == "float32" and not self.g.is_output(v) and \
            bool(v.users) and all(self.decision(u).granted == "BF16" for u in v.users)

    def written_bf16(self, v: Value) -> bool:
        """Whether the layer writing `v` (lowered already) can write it in bf16."""
        start, end = self.node_layers.get(v.producer.name, (0, 0)) if v.producer is not None else (0, 0)
        return any(writes_bf16(layer) for layer in self.layers[start:end] if v.name in (d.name for d in layer.outputs))

    def stamped(self, layer: Layer, node: Node) -> Layer:
        d = self.decision(node)
        return dataclasses.replace(layer, precision=d.granted, requested_precision=d.requested,
                                   precision_reason=d.reason)

    def lower_region(self, node: Node) -> None:
        """A Region node becomes one layer run by its library; its inner layers stay visible in layer info."""
        tactic, source = (OPENVINO_REGION_TACTIC, "openvino") if node.attrs.get("library") == "openvino" else \
            (REGION_TACTIC, "onnxruntime")
        args, in_descs, rename = [], [], {}
        for i, v in enumerate(node.inputs):
            if v.is_const:
                args.append(self.weight(v))
                continue
            name = v.name
            if self.formats[name] != LINEAR and len(v.shape) == 4:
                name = self.reformat(name, LINEAR, node.name, i)
            rename[v.name] = name
            args.append(Arg("tensor", name))
            in_descs.append(self.descs[name])
        inner = []
        for n in node.attrs["nodes"]:
            iargs, idescs = [], []
            for v in n.inputs:
                if v is None:
                    iargs.append(Arg("none"))
                elif v.is_const:
                    iargs.append(self.weight(v))
                else:
                    iargs.append(Arg("tensor", rename.get(v.name, v.name)))
                    idescs.append(desc_of(v, rename.get(v.name, v.name)))
            inner.append(self.stamped(Layer(n.name, n.op_type, n.domain, tuple(iargs), tuple(idescs),
                                            tuple(desc_of(o) for o in n.outputs), dict(n.attrs), tactic,
                                            tactic_value(tactic), source, n.origin), n))
        outs = tuple(desc_of(v) for v in node.outputs)
        for t in outs:
            self.descs[t.name], self.formats[t.name] = t, LINEAR
        attrs = {"precision": node.attrs["precision"]} if "precision" in node.attrs else {}
        self.layers.append(Layer(node.name, "Region", "kiln", tuple(args), tuple(in_descs), outs, attrs, tactic,
                                 tactic_value(tactic), source, node.origin, inner=tuple(inner)))

    def lower_node(self, node: Node) -> None:
        if node.op_type == "Region" and node.domain == "kiln":
            self.lower_region(node)
            return
        view = node_view(node, self.g.opset)
        tactic = self.pick(node, view)
        self.picked[node.name] = tactic.name
        args, in_descs, in_formats = self.wire_inputs(node, tactic.input_formats(view))
        out_format = tactic.output_format(view, in_formats)
        outs = []
        for j, v in enumerate(node.outputs):
            fmt = out_format if len(v.shape) == 4 else LINEAR
            name = reformat_names("Output", j, node.name)[1] if self.g.is_output(v) and fmt != LINEAR else v.name
            desc = desc_of(v, name, fmt)
            self.descs[name], self.formats[name] = desc, fmt
            outs.append(desc)
        self.layers.append(self.stamped(Layer(node.name, node.op_type, node.domain, tuple(args), tuple(in_descs),
                                              tuple(outs), dict(node.attrs), tactic.name, tactic_value(tactic.name),
                                              tactic.source, node.origin), node))
        for j, v in enumerate(node.outputs):
            if outs[j].name != v.name:   # a graph output in another layout: copied back to row-major
                self.reformat(outs[j].name, LINEAR, node.name, j, public_name=v.name)

    def wire_inputs(self, node: Node, wanted: list[str]) -> tuple[list[Arg], list[TensorDesc], list[str]]:
        """The node's arguments, with a Reformat in front of each 4-D input whose layout differs from `wanted`."""
        args, in_descs, in_formats = [], [], []
        for i, v in enumerate(node.inputs):
            if v is None:
                args.append(Arg("none"))
                continue
            if v.is_const:
                args.append(self.weight(v))
                continue
            name = v.name
            if wanted[i] not in (ANY, self.formats[name]) and len(v.shape) == 4:
                name = self.reformat(name, wanted[i], node.name, i)
            args.append(Arg("tensor", name))
            in_descs.append(self.descs[name])
            in_formats.append(self.formats[name])
        return args, in_descs, in_formats


def lower(g: Graph, sources: frozenset[str] | None, tuner: Autotuner | None = None,
          precisions: dict[str, PrecisionDecision] | None = None, strict_precision: bool = True,
          prefer_source: str | None = None) -> tuple[list[Layer], dict[str, np.ndarray]]:
    """The graph's layers and weights (see `Lowering`)."""
    return Lowering(g, sources, tuner, precisions, strict_precision, prefer_source=prefer_source).run()
