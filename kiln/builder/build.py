"""The builder: ONNX -> IR -> passes -> tactic per layer (with explicit Reformat layers) -> memory plan -> Plan."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from kiln.version import __version__
from kiln.planning.memory import plan_memory
from kiln.trt.vocab import tensor_text
from kiln.plan.model import Arg, Layer, Plan, TensorDesc
from kiln.frontend import import_onnx, load_model
from kiln.ir import Graph, Node
from kiln.ops import lookup
from kiln.passes import DEFAULT_PIPELINE, run_passes
from kiln.precision.policy import PrecisionOptions
from kiln.precision.policy import assign as assign_precisions
from kiln.tactics.base import ANY, LINEAR, LayerView, tactic_value
from kiln.tactics.registry import available_sources, candidates
from kiln.planning.regions import _view, apply_regions, choose_regions, measure_plans, unapply_regions
from kiln.tactics.onnx_emit import supports
from kiln.tactics.autotune import Autotuner, TimingOptions, last_level_cache_bytes
from kiln.tactics.onnxruntime_source import REGION_TACTIC
from kiln.tactics.openvino_source import OPENVINO_REGION_TACTIC
from kiln.tactics.timing_cache import TimingCache, device_description
from kiln.tactics.reformat import NOOP_TACTIC, REFORMAT_TACTIC, is_noop_reformat
from kiln.tactics.codegen import CODEGEN_TACTIC
from kiln.tactics.winograd import WINOGRAD_PREFIX

log = logging.getLogger("kiln.build")

PARAMETER_TYPES = {"Conv": "Convolution", "Gemm": "MatrixMultiply", "MatMul": "MatrixMultiply",
                   "QConv": "Convolution", "QGemm": "MatrixMultiply", "QMatMul": "MatrixMultiply",
                   "PointWise": "PointWise", "Shuffle": "Shuffle"}
RUNNER_TYPES = {"onednn.conv2d_nhwc_prepacked": "OneDnnConvolution", "onednn.linear_prepacked": "OneDnnMatrixMultiply",
                CODEGEN_TACTIC: "PointWiseV2"}


def runner_type(tactic_name: str, parameter_type: str) -> str:
    """TensorRT's LayerType names the runner: kiln names the kernel library and the layer kind."""
    if tactic_name.startswith("onnxruntime."):
        return f"OnnxRuntime{parameter_type}"
    if tactic_name.startswith(WINOGRAD_PREFIX):   # every tile size
        return "WinogradConvolution"
    return RUNNER_TYPES.get(tactic_name, parameter_type)


@dataclass(frozen=True)
class BuildOptions:
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    profiles: tuple[dict[str, tuple], ...] = ()   # per profile: input -> (min, opt, max) shapes
    disabled_passes: frozenset[str] = frozenset()
    tactic_sources: frozenset[str] | None = None
    verify_each: bool = False
    autotune: bool = True
    regions: bool = True            # let onnxruntime run whole segments where that is faster
    timing_cache: str | None = None
    deterministic: bool = False     # only recorded timings from the cache; never measure
    avg_timing: int = 8
    min_timing: int = 3
    precision: PrecisionOptions = PrecisionOptions()
    calibration: str | None = None   # --int8 without Q/DQ: calibration data (.npz / folder) or cache (.json)
    calibration_method: str = "entropy"   # entropy (TensorRT's default), minmax, percentile
    calibration_cache: str | None = None  # write the computed scales here (JSON)


def build_plan(model: str | os.PathLike | onnx.ModelProto, options: BuildOptions = BuildOptions()) -> Plan:
    start = time.perf_counter()
    proto = load_model(model)
    if options.calibration:
        proto = calibrated(proto, options)
    g = import_onnx(proto, options.input_shapes, list(options.profiles))
    stats = run_passes(g, DEFAULT_PIPELINE, options.disabled_passes, options.verify_each)
    sources = options.tactic_sources if options.tactic_sources is not None else available_sources()
    cache = TimingCache(device_description(torch.get_num_threads()), options.timing_cache, options.deterministic)
    weight_bytes, cache_bytes = sum(v.const.nbytes for v in g.values.values() if v.is_const), last_level_cache_bytes()
    cold = weight_bytes > cache_bytes
    if options.autotune:
        log.info("Timing tactics with %s caches: %.1f MiB of weights %s the %.0f MiB last-level cache", "cold" if cold
                 else "hot", weight_bytes / 2**20, "exceed" if cold else "fit in", cache_bytes / 2**20)
    tuner = Autotuner(cache, TimingOptions(options.avg_timing, options.min_timing), cold) if options.autotune else None
    layers, weights = lower_with_regions(g, sources, tuner, options.regions, lambda: onnxruntime_reference(proto))
    layers = assign_precisions(layers, options.precision)
    cache.save()
    warm_compiled_model_cache(layers, weights, g.opset)
    inputs = tuple(desc_of(v) for v in g.inputs)
    outputs = tuple(desc_of(v) for v in g.outputs)
    memory = plan_memory(layers, inputs, outputs)
    log_engine_layers(layers)
    log.debug("Total Activation Memory: %d bytes (%d bytes without reuse)", memory.total_bytes, memory.unshared_bytes)
    log.debug("Total Weights Memory: %d bytes", sum(w.nbytes for w in weights.values()))
    info = {
        "kiln_version": __version__, "torch_version": torch.__version__, "opset": g.opset,
        "build_time_s": round(time.perf_counter() - start, 6), "device": "cpu",
        "tactic_sources_available": sorted(available_sources()), "tactic_sources": sorted(sources),
        "timing_cache": {"hits": cache.hits, "misses": cache.misses}, "device_description": cache.device,
        "passes": [{"name": s.name, "matches": s.matches, "rejections": s.rejections,
                    "layers_before": s.layers_before, "layers_after": s.layers_after} for s in stats],
    }
    log.info("Engine built in %.5f sec.", info["build_time_s"])
    return Plan(g.name, inputs, outputs, tuple(layers), weights, memory, info, tuple(g.profiles))


def warm_compiled_model_cache(layers: list[Layer], weights: dict[str, np.ndarray], opset: int) -> None:
    """Compile the chosen plan's OpenVINO regions once through OpenVINO's model cache, so the engine's first load
    imports the compiled blob instead of compiling (about 0.2 s instead of 0.9 s for ResNet-50). Only the chosen
    plan's regions are written: the candidates timed during the build never touch the cache."""
    from kiln.runtime.prepare import prepare_region

    for layer in layers:
        if layer.tactic_name == OPENVINO_REGION_TACTIC:
            try:
                prepare_region(layer, weights, opset, cached=True, library="openvino")
            except Exception as exc:   # the build already ran this region; a cache it cannot write is not an error
                log.debug("OpenVINO model cache not warmed for %s: %s", layer.name, exc)


def calibrated(proto: onnx.ModelProto, options: BuildOptions) -> onnx.ModelProto:
    """Implicit INT8 (--int8 --calib): scales from calibration data or a cache become Q/DQ nodes, so the rest of
    the build is the explicit-quantization path."""
    from kiln.errors import ModelError
    from kiln.preprocess.calibration import calibrate, quantize_with_qdq

    if not options.precision.int8:
        raise ModelError("calibration data was given without --int8; add --int8 (or drop --calib)")
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node):
        raise ModelError("the model already has Q/DQ nodes (explicit quantization); build it without --calib")
    scales = calibrate(proto, options.calibration, options.calibration_method, options.calibration_cache)
    log.info("INT8 calibration (%s): %d activation scales from %s", options.calibration_method, len(scales),
             options.calibration)
    return quantize_with_qdq(proto, scales)


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


def desc_of(v, name: str | None = None, fmt: str = LINEAR) -> TensorDesc:
    return TensorDesc(name or v.name, v.shape, str(v.dtype), fmt, tuple(v.dyn_dims))


def log_engine_layers(layers: list[Layer]) -> None:
    """TensorRT's verbose "Engine Layer Information" dump, one line per layer."""
    log.debug("Engine Layer Information:")
    for layer in layers:
        ins = ", ".join(tensor_text(t) for t in layer.inputs)
        outs = ", ".join(tensor_text(t) for t in layer.outputs)
        log.debug("Layer(%s): %s, Tactic: 0x%016x, %s -> %s", layer.layer_type, layer.name, layer.tactic_value, ins, outs)


class _Lowering:
    """Walks the optimized graph in order, choosing tactics and inserting Reformat layers between layouts."""

    def __init__(self, g: Graph, sources: frozenset[str] | None, tuner: Autotuner | None = None,
                 measure_all: bool = False):
        self.g, self.sources, self.tuner, self.measure_all = g, sources, tuner, measure_all
        self.node_ms: dict[str, float] = {}
        self.node_layers: dict[str, tuple[int, int]] = {}
        self.layers: list[Layer] = []
        self.weights: dict[str, np.ndarray] = {}
        self.formats: dict[str, str] = {v.name: LINEAR for v in g.inputs}
        self.descs: dict[str, TensorDesc] = {v.name: desc_of(v) for v in g.inputs}
        self.reformatted: dict[tuple[str, str], str] = {}
        self.position = {id(n): i for i, n in enumerate(g.nodes)}

    def weight(self, v) -> Arg:
        self.weights.setdefault(v.name, np.ascontiguousarray(v.const).reshape(v.const.shape))
        return Arg("weight", v.name)

    def reformat(self, src: str, target: str, consumer: str, index: int, public_name: str | None = None) -> str:
        """Insert a Reformat layer copying `src` into `target` layout (TensorRT's naming), reused per tensor."""
        if public_name is None and (src, target) in self.reformatted:
            return self.reformatted[(src, target)]
        d = self.descs[src]
        if public_name is None:
            name, new = f"Reformatting CopyNode for Input Tensor {index} to {consumer}", \
                f"Reformatted Input Tensor {index} to {consumer}"
            self.reformatted[(src, target)] = new
        else:
            name, new = f"Reformatting CopyNode for Output Tensor {index} to {consumer}", public_name
        out = dataclasses.replace(d, name=new, format=target)
        noop = is_noop_reformat(d.dims) and not d.dynamic
        tactic = NOOP_TACTIC if noop else REFORMAT_TACTIC
        self.layers.append(Layer(name, "Reformat", "kiln", "NoOp" if noop else "Reformat", "Reformat",
                                 (Arg("tensor", src),), (d,), (out,), {"origin": "REFORMAT", "target_format": target},
                                 tactic, tactic_value(tactic), ()))
        self.formats[new], self.descs[new] = target, out
        return new

    def finish(self) -> None:
        """Outputs computed entirely at build time become Constant layers."""
        for v in self.g.outputs:
            if v.is_const:
                self.layers.append(Layer(f"{v.name} [Constant]", "Constant", "kiln", "Constant", "Constant",
                                         (self.weight(v),), (), (desc_of(v),), {},
                                         "kiln.constant", tactic_value("kiln.constant"), ()))

    def dying_inputs(self, node: Node) -> frozenset[int]:
        """Indices of `node`'s activation inputs that no later node reads and the graph does not return."""
        here = self.position[id(node)]
        return frozenset(i for i, v in enumerate(node.inputs)
                         if v is not None and not v.is_const and v.producer is not None and not self.g.is_output(v)
                         and all(self.position.get(id(u), -1) <= here for u in v.users)
                         and sum(x is v for x in node.inputs) == 1)

    @staticmethod
    def parameter_type(node: Node) -> str:
        return PARAMETER_TYPES.get(node.op_type) or lookup(node.op_type, node.domain).trt_layer

    def pick(self, node: Node, view: LayerView):
        found = candidates(view, self.sources)
        if self.tuner is None or (len(found) == 1 and not self.measure_all) or runtime_shape_inputs(node):
            return found[0]   # shape arithmetic on dynamic axes: random timing inputs would be meaningless
        have = [None if v is None or v.is_const else self.formats[v.name] for v in node.inputs]
        ptype = self.parameter_type(node)
        names = {t.name: runner_type(t.name, ptype) for t in found}
        choice = self.tuner.choose(node.name, view, found, have, names, self.dying_inputs(node))
        self.node_ms[node.name] = choice.kernel_ms + choice.overhead_ms
        return choice.tactic

    def lower_region(self, node: Node) -> None:
        """A Region node becomes one layer run by onnxruntime; its inner layers stay visible in layer info."""
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
            ptype = self.parameter_type(n)
            inner.append(Layer(n.name, n.op_type, n.domain, runner_type(REGION_TACTIC, ptype), ptype, tuple(iargs),
                               tuple(idescs), tuple(desc_of(o) for o in n.outputs),
                               _jsonable_attrs(n.attrs), REGION_TACTIC, tactic_value(REGION_TACTIC), n.origin))
        outs = tuple(desc_of(v) for v in node.outputs)
        for t in outs:
            self.descs[t.name], self.formats[t.name] = t, LINEAR
        tactic, runner = (OPENVINO_REGION_TACTIC, "OpenVINO") if node.attrs.get("library") == "openvino" else \
            (REGION_TACTIC, "OnnxRuntime")
        inner = [dataclasses.replace(i, tactic_name=tactic, tactic_value=tactic_value(tactic),
                                     layer_type=i.layer_type.replace("OnnxRuntime", runner)) for i in inner]
        self.layers.append(Layer(node.name, "Region", "kiln", runner, "ForeignNode", tuple(args), tuple(in_descs),
                                 outs, {}, tactic, tactic_value(tactic), node.origin, inner=tuple(inner)))

    def lower_node(self, node: Node) -> None:
        if node.op_type == "Region" and node.domain == "kiln":
            self.lower_region(node)
            return
        const_inputs = {i: torch.from_numpy(np.array(v.const)) for i, v in enumerate(node.inputs)
                        if v is not None and v.is_const}
        view = LayerView(node.op_type, node.domain, node.attrs, tuple(None if v is None else v.shape for v in node.inputs),
                         tuple(None if v is None else str(v.dtype) for v in node.inputs), const_inputs,
                         tuple(str(v.dtype) for v in node.outputs), self.g.opset,
                         tuple(() if v is None else v.dyn_dims for v in node.inputs))
        tactic = self.pick(node, view)
        wanted = tactic.input_formats(view)
        args, in_descs, in_formats = [], [], []
        for i, v in enumerate(node.inputs):
            if v is None:
                args.append(Arg("none"))
                continue
            if v.is_const:
                args.append(self.weight(v))
                continue
            name = v.name
            have = self.formats[name]
            if wanted[i] != ANY and wanted[i] != have and len(v.shape) == 4:
                name = self.reformat(name, wanted[i], node.name, i)
            args.append(Arg("tensor", name))
            in_descs.append(self.descs[name])
            in_formats.append(self.formats[name])
        out_format = tactic.output_format(view, in_formats)
        outs = []
        for j, v in enumerate(node.outputs):
            fmt = out_format if len(v.shape) == 4 else LINEAR
            name = v.name
            public = self.g.is_output(v) and fmt != LINEAR
            if public:
                name = f"Reformatted Output Tensor {j} to {node.name}"
            desc = desc_of(v, name, fmt)
            self.descs[name], self.formats[name] = desc, fmt
            outs.append(desc)
        ptype = self.parameter_type(node)
        runner = runner_type(tactic.name, ptype)
        self.layers.append(Layer(node.name, node.op_type, node.domain, runner, ptype, tuple(args), tuple(in_descs),
                                 tuple(outs), _jsonable_attrs(node.attrs), tactic.name, tactic_value(tactic.name),
                                 node.origin))
        for j, v in enumerate(node.outputs):
            if outs[j].name != v.name:
                self.reformat(outs[j].name, LINEAR, node.name, j, public_name=v.name)


PLAN_MARGIN = 0.03   # a mixed kiln/onnxruntime plan must beat one whole onnxruntime region by 3% to be taken
# An external library's whole-graph region must beat kiln's own plan by this much: within it the two are a tie
# under this machine's timing noise, and kiln's own plan is the one whose layers can be inspected, profiled and
# fused (a region is one opaque layer).
OWN_PLAN_MARGIN = 0.03
OWN_PLANS = ("kiln", "kiln-direct")


def onnxruntime_reference(proto: onnx.ModelProto):
    """A function running the ORIGINAL model in onnxruntime (the ground truth plans are checked against), or None."""
    try:
        from kiln.optional import require

        ort = require("onnxruntime", "checking plans against the ONNX model")
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:   # not installed, too large to serialize, or a model it rejects: no reference
        log.debug("No onnxruntime reference for plan checks: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return None

    def run(inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        feeds = {name: t.contiguous().numpy() for name, t in inputs.items()}
        return [torch.from_numpy(np.asarray(y)) for y in sess.run(None, feeds)]
    return run


def lower_with_regions(g: Graph, sources: frozenset[str], tuner: Autotuner | None, regions: bool,
                       make_reference=lambda: None):
    """Lower with per-layer tactics; then time whole candidate plans end to end: all kiln kernels, the whole
    graph as one onnxruntime region, and the mix the segment cost model proposes. Keep the fastest."""
    if tuner is None or not regions or not ({"onnxruntime", "openvino"} & sources):
        return lower(g, sources, tuner)
    first = _Lowering(g, sources, tuner)
    for node in g.nodes:
        start = len(first.layers)
        first.lower_node(node)
        first.node_layers[node.name] = (start, len(first.layers))
    first.finish()
    whole = all(supports(_view(n, g.opset)) for n in g.nodes)
    proposals = {"kiln": []}
    if "onnxruntime" in sources:
        runs = choose_regions(g, first.node_layers, first.layers, first.descs, first.weights, first.formats, tuner)
        if whole:
            proposals["onnxruntime"] = [list(g.nodes)]
        if runs and runs != [list(g.nodes)]:
            proposals["mixed"] = runs
    if "openvino" in sources and whole:
        proposals["openvino"] = [list(g.nodes)]
    candidates = {"kiln": (first.layers, first.weights)}
    if any(l.tactic_name.startswith(WINOGRAD_PREFIX) for l in first.layers):
        # per-layer timing runs each kernel with hot caches, which flatters Winograd's larger transformed weights:
        # the same plan without it is timed end to end too, and the faster one stays
        proposals["kiln-direct"] = []
        candidates["kiln-direct"] = lower(g, sources - {"kiln"}, tuner)
    for name, proposal in proposals.items():
        if proposal and name not in candidates:
            apply_regions(g, proposal, "openvino" if name == "openvino" else "onnxruntime")
            try:
                layers, weights = lower(g, sources, tuner)
                candidates[name] = (allow_spinning(layers), weights)
            except Exception as exc:   # the library rejects the graph: that plan is simply not a candidate
                log.debug("%s plan unavailable: %s", name, exc)
            unapply_regions(g)
    times = measure_plans(candidates, first.descs, g, tuner, make_reference())   # a session only when plans compete
    best = min(times, key=times.get)
    if best == "mixed" and "onnxruntime" in times and times[best] > times["onnxruntime"] * (1 - PLAN_MARGIN):
        best = "onnxruntime"   # torch and onnxruntime handing over cores: a mix must win clearly to be trusted
    own = min((k for k in OWN_PLANS if k in times), key=times.get, default=None)
    if best not in OWN_PLANS and own is not None and times[best] > times[own] * (1 - OWN_PLAN_MARGIN):
        log.debug("The %s plan (%.4g ms) is within %d%% of kiln's own (%.4g ms): keeping kiln's own", best,
                  times[best], round(OWN_PLAN_MARGIN * 100), times[own])
        best = own
    log.debug("Whole-plan latency: %s -> %s", ", ".join(f"{k} {v:.4g} ms" for k, v in times.items()), best)
    if proposals[best]:
        apply_regions(g, proposals[best], "openvino" if best == "openvino" else "onnxruntime")
        log.debug("After region formation: %d layers (%d onnxruntime region(s))", len(g.nodes), len(proposals[best]))
    return candidates[best]


CHEAP_LAYERS = ("Reformat", "Shuffle", "Constant")


def allow_spinning(layers: list[Layer]) -> list[Layer]:
    """onnxruntime may spin its threads between operators only when no torch kernel shares the cores."""
    import dataclasses

    alone = all(l.tactic_name == REGION_TACTIC or l.op_type in CHEAP_LAYERS for l in layers)
    regions = sum(1 for l in layers if l.tactic_name == REGION_TACTIC)
    if not (alone and regions == 1):
        return layers
    return [dataclasses.replace(l, attrs={**l.attrs, "spinning": True}) if l.tactic_name == REGION_TACTIC else l
            for l in layers]


def lower(g: Graph, sources: frozenset[str] | None,
          tuner: Autotuner | None = None) -> tuple[list[Layer], dict[str, np.ndarray]]:
    low = _Lowering(g, sources, tuner)
    for node in g.nodes:
        low.lower_node(node)
    low.finish()
    return low.layers, low.weights


def _jsonable_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return dict(attrs)
