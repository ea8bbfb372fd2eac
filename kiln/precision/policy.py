"""The precision stage: per layer of the optimized graph, what was requested (build flags, per-layer constraints,
Q/DQ), what kiln grants, and why they differ, decided BEFORE lowering, so tactics are chosen (and timed) for the
granted precision and `--precision-constraints obey` fails before any timing. TensorRT falls back silently; kiln
records every difference in the plan, the layer info (`RequestedPrecision`, `GrantedPrecision`,
`PrecisionReason`) and the build log.

Requests, strongest first: `--layer-precisions name:type` (trtexec spelling, `*` for all layers), explicit
quantization (Q/DQ around a layer asks for INT8), `--int8` for layers with an INT8 kernel, `--fp16`/`--bf16`,
else FP32. `--precision-constraints obey` turns an unmet request into a build error; `prefer` and `none`
fall back to the best available precision with the reason recorded."""
from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kiln import hardware
from kiln.errors import ModelError
from kiln.ir import Graph, Node
from kiln.ops import OpKind, lookup
from kiln.ops.dtypes import is_float

log = logging.getLogger("kiln.build")

PRECISIONS = ("FP32", "FP16", "BF16", "INT8")
CONSTRAINTS = ("none", "prefer", "obey")
INT8_LAYERS = ("QConv", "QMatMul", "QGemm", "QAdd", "QSoftmax", "QLayerNorm", "QConcat", "QAveragePool", "QResize",
               "DynamicQMatMul", "DynamicQConv", "QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger",
               "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSigmoid",
               "QLinearLeakyRelu")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
INT8_CAPABLE = ("Conv", "MatMul", "Gemm")
TYPE_NAMES = {"fp32": "FP32", "float": "FP32", "fp16": "FP16", "half": "FP16", "bf16": "BF16", "int8": "INT8"}


@dataclass(frozen=True)
class PrecisionOptions:
    fp16: bool = False
    bf16: bool = False
    int8: bool = False
    layer_precisions: dict[str, str] = field(default_factory=dict)   # layer name (glob) -> FP32|FP16|BF16|INT8
    constraints: str = "none"                                         # none | prefer | obey
    best: bool = False   # trtexec --best: every precision kiln has kernels for (Q/DQ layers INT8, the rest BF16)
    strongly_typed: bool = False   # trtexec --stronglyTyped: compute in the model's own float types, allow no other

    def __post_init__(self):
        if self.constraints not in CONSTRAINTS:
            raise ModelError(f"unknown precision constraints '{self.constraints}'; use one of {', '.join(CONSTRAINTS)}")
        bad = {k: v for k, v in self.layer_precisions.items() if v not in PRECISIONS}
        if bad:
            raise ModelError(f"unknown layer precision(s) {bad}; use one of {', '.join(PRECISIONS)}")
        allowed = [flag for flag in ("fp16", "bf16", "int8", "best") if getattr(self, flag)]
        if self.strongly_typed and (allowed or self.layer_precisions):
            given = [f"--{flag}" for flag in allowed] + (["--layer-precisions"] if self.layer_precisions else [])
            raise ModelError(f"a strongly typed build takes every precision from the model's types; drop "
                             f"{', '.join(given)} or --strongly-typed")


def parse_layer_precisions(spec: str | None) -> dict[str, str]:
    """trtexec's `--layerPrecisions=conv1:fp16,*:fp32`."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, sep, kind = item.rpartition(":")
        if not sep or kind.lower() not in TYPE_NAMES:
            raise ModelError(f"bad layer precision '{item}': expected name:fp32|fp16|bf16|int8")
        out[name.strip("'\"")] = TYPE_NAMES[kind.lower()]
    return out


def cpu_reduced_float_support() -> dict[str, bool]:
    """Whether this CPU computes FP16/BF16 natively (kiln.hardware)."""
    return {"FP16": hardware.has_any(hardware.FP16_ISA), "BF16": hardware.has_any(hardware.BF16_ISA)}


@dataclass(frozen=True)
class PrecisionDecision:
    """One layer's precision: what the build asked for, what kiln grants, and why they differ ("" when equal)."""

    requested: str
    granted: str
    reason: str = ""


def native_precision(op_type: str, output_dtypes: Iterable, input_dtypes: Iterable = ()) -> str:
    """The precision a layer's own types fix: INT8 for quantized ops and int8 outputs; FP16 where it reads float16
    (or, reading no float, writes it): a layer's arithmetic takes its inputs' type, so one reading float32 and
    writing float16 (a fused output Cast) computes in FP32; a Cast only converts (FP32); else FP32."""
    output_dtypes, input_dtypes = list(output_dtypes), list(input_dtypes)
    if op_type in INT8_LAYERS or _eight_bit_qdq(op_type, [*output_dtypes, *input_dtypes]):
        return "INT8"
    dtypes = [np.dtype(d) for d in output_dtypes]
    if any(d in (np.dtype(np.int8), np.dtype(np.uint8)) for d in dtypes):
        return "INT8"
    if op_type == "Cast":
        return "FP32"
    floats_in = [np.dtype(d) for d in input_dtypes if d is not None and is_float(d)]
    if any(d == np.float16 for d in floats_in or dtypes):
        return "FP16"
    return "FP32"


def named_precision(name: str, options: PrecisionOptions, origin: Iterable[str] = ()) -> str | None:
    """The precision the first `--layer-precisions` pattern naming the layer asks for, else None. A pattern names
    a layer by its own name or by any ONNX node it computes (`origin`): "small:fp32" still reaches "small + sum"
    once a fusion renamed it, where TensorRT's patterns see only the fused name."""
    names = (name, *origin)
    return next((kind for pattern, kind in options.layer_precisions.items()
                 if any(fnmatch.fnmatchcase(n, pattern) for n in names)), None)


def _eight_bit_qdq(op_type: str, dtypes: list) -> bool:
    """A Q/DQ op of an INT8 type: a 16-bit one (onnxruntime's QUInt16/QInt16 activations) is emulated in FP32, as
    kiln has no 16-bit integer kernels (TensorRT has no such type)."""
    sixteen = {np.dtype(np.int16), np.dtype(np.uint16)}
    return op_type in QDQ_OPS and not any(d is not None and np.dtype(d) in sixteen for d in dtypes)


def requested(name: str, op_type: str, output_dtypes: Iterable, options: PrecisionOptions,
              origin: Iterable[str] = (), input_dtypes: Iterable = ()) -> str:
    named = named_precision(name, options, origin)
    if named is not None:
        return named
    output_dtypes, input_dtypes = list(output_dtypes), list(input_dtypes)
    if op_type in INT8_LAYERS or _eight_bit_qdq(op_type, [*output_dtypes, *input_dtypes]):
        return "INT8"
    if op_type in QDQ_OPS:
        return "FP32"   # 16-bit Q/DQ
    float_out = any(is_float(d) for d in output_dtypes)
    # a layer that reads and writes no float (a mask's Cast to bool, And, Expand) has nothing to compute in BF16/FP16
    floats = float_out or any(d is not None and is_float(d) for d in input_dtypes)
    if options.best:
        # INT8 only where the model's Q/DQ gives scales (above); BF16 beats FP16 where both are
        return "BF16" if floats else "FP32"
    if options.int8 and (op_type in INT8_CAPABLE or float_out):
        return "INT8"   # --int8 allows INT8 everywhere, as TensorRT's flag does; kiln says where it was not given
    if (options.bf16 or options.fp16) and floats:
        return "BF16" if options.bf16 and not options.fp16 else "FP16"
    return "FP32"


def allowed_floats(options: PrecisionOptions) -> tuple[str, ...]:
    """The reduced float precisions the flags allow, preferred first (as `requested` prefers them): a layer denied
    the one it asked for (INT8 without a scale, FP16 on a CPU without FP16 arithmetic) falls back to another, as
    TensorRT's builder picks among every precision its flags allow (--int8 --fp16)."""
    if options.best:
        return ("BF16", "FP16")
    return tuple(p for p, flag in (("FP16", options.fp16), ("BF16", options.bf16)) if flag)


def reason(op_type: str, want: str, got: str, support: dict[str, bool]) -> str:
    if want == got:
        return ""
    if want in ("FP16", "BF16"):
        why = f"this CPU has no native {want} arithmetic" if not support.get(want) else \
            f"kiln has no {want} kernel for {op_type}"
        return f"{why}; it runs in {got}"
    if want == "INT8" and got in ("FP32", *REDUCED_FLOATS):
        why = "no input scale: INT8 needs Q/DQ around the layer or calibration (--int8 --calib)" \
            if op_type in INT8_CAPABLE else f"no INT8 kernel for {op_type}"
        return why if got == "FP32" else f"{why}; it runs in {got}, also allowed"
    if want == "FP32" and got == "INT8":
        return "the model's Q/DQ nodes fix this layer to INT8"
    return f"{want} is not available for {op_type}"


REDUCED_FLOATS = ("BF16", "FP16")
KernelOffers = Callable[[Node, str], bool]   # (node, precision) -> does an enabled tactic compute it so?
OUTPUT_TAIL = ("it computes the network's output after its last matrix layer, where BF16/FP16 saves little and "
               "rounds the result (a detector's box arithmetic to ~2 px at 640); it runs in FP32 (--layer-precisions "
               "NAME:bf16 overrides)")


def output_tail(g: Graph) -> frozenset[str]:
    """The arithmetic layers after the last matrix layers: nodes (neither matrix layers nor pure data movement)
    whose every output only reaches graph outputs, through no matrix layer. OpenVINO keeps such tails in f32 too
    (YOLOv8's box decoding and class Sigmoid; an encoder's last residual Add and LayerNorm, not the residual Adds
    before them, which also feed the next block's matrices)."""
    pure: set[str] = set()
    for node in reversed(g.nodes):
        outs = [v for v in node.outputs if v is not None]
        users = [u for v in outs for u in v.users]
        if (users or any(g.is_output(v) for v in outs)) and all(u.name in pure and not _matrix(u) for u in users):
            pure.add(node.name)
    return frozenset(n.name for n in g.nodes if n.name in pure and not _matrix(n) and not _moves_data(n))


def _matrix(node: Node) -> bool:
    """A layer whose arithmetic a reduced float precision speeds up: convolutions, matrix products, attention."""
    opdef = lookup(node.op_type, node.domain)
    return node.op_type == "Attention" or (opdef is not None and opdef.kind == OpKind.COMPLEX)


def _moves_data(node: Node) -> bool:
    """A layer that only moves data (exact in bf16): Concat, Reshape, Gather, ...; Resize interpolates."""
    opdef = lookup(node.op_type, node.domain)
    return opdef is not None and opdef.kind == OpKind.INJECTIVE and node.op_type != "Resize"


def decide(nodes: Iterable[Node], options: PrecisionOptions, kernel_offers: KernelOffers,
           support: dict[str, bool] | None = None, tail: frozenset[str] = frozenset()) -> dict[str, PrecisionDecision]:
    """Each node's decision, by node name. A node runs at its native precision (`native_precision`) unless it is
    FP32-native and some enabled tactic computes it in the requested precision (`kernel_offers`, asked only for
    requests that differ from the native one); without precision constraints the `tail` (`output_tail`) keeps
    FP32 unless a layer precision names it. Under `--precision-constraints obey` the first unmet request raises,
    naming the layer."""
    support = cpu_reduced_float_support() if support is None else support
    nodes = list(nodes)
    _warn_unmatched(nodes, options)
    decisions = {}
    for node in nodes:
        dtypes = [v.dtype for v in node.outputs if v is not None and v.dtype is not None]
        reads = [v.dtype for v in node.inputs if v is not None and v.dtype is not None]
        want = requested(node.name, node.op_type, dtypes, options, node.origin, reads)
        native = native_precision(node.op_type, dtypes, reads)
        if want in REDUCED_FLOATS and node.name in tail and native == "FP32" and options.constraints == "none" \
                and named_precision(node.name, options, node.origin) is None:
            decisions[node.name] = PrecisionDecision(want, native, OUTPUT_TAIL)
            log.info("Layer %s: requested %s, granted %s: %s", node.name, want, native, OUTPUT_TAIL)
            continue
        got = want if want != native and native == "FP32" and kernel_offers(node, want) else native
        if want != "FP32" and got == "FP32" and node.name not in tail:
            got = next((p for p in allowed_floats(options) if p != want and kernel_offers(node, p)), got)
        why = reason(node.op_type, want, got, support)
        if why:
            if options.constraints == "obey" and want != "FP32":
                raise ModelError(f"layer '{node.name}' ({node.op_type}): --precision-constraints obey asks for "
                                 f"{want}, which kiln cannot give: {why}")
            log.info("Layer %s: requested %s, granted %s: %s", node.name, want, got, why)
        decisions[node.name] = PrecisionDecision(want, got, why)
    _warn_none_granted(decisions)
    return decisions


def _warn_none_granted(decisions: dict[str, PrecisionDecision]) -> None:
    """One warning per precision asked for and granted to no layer (`--int8` on a model without Q/DQ or --calib,
    `--fp16` on a CPU without FP16 arithmetic), naming the commonest reason: the per-layer lines are info."""
    for precision in ("INT8", "BF16", "FP16"):
        asked = [d for d in decisions.values() if d.requested == precision]
        if asked and not any(d.granted == precision for d in decisions.values()):
            reasons = Counter(d.reason for d in asked if d.reason)
            why = f": {reasons.most_common(1)[0][0]}" if reasons else ""
            log.warning("%s was asked for by %d layer(s) and granted to none%s", precision, len(asked), why)


def _warn_unmatched(nodes: list[Node], options: PrecisionOptions) -> None:
    """One warning per `--layer-precisions` pattern that names no layer and no ONNX node (a typo TensorRT ignores)."""
    names = [n for node in nodes for n in (node.name, *node.origin)]
    for pattern in options.layer_precisions:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            log.warning("--layer-precisions: '%s' names no layer and no ONNX node of this model", pattern)
