"""Precision per layer: what was requested (build flags, per-layer constraints, Q/DQ), what kiln granted, and
why they differ. TensorRT falls back silently; kiln records every difference in the plan, the layer info
(`RequestedPrecision`, `GrantedPrecision`, `PrecisionReason`) and the build log.

Requests, strongest first: `--layer-precisions name:type` (trtexec spelling, `*` for all layers), explicit
quantization (Q/DQ around a layer asks for INT8), `--int8` for layers with an INT8 kernel, `--fp16`/`--bf16`,
else FP32. `--precision-constraints obey` turns an unmet request into a build error; `prefer` and `none`
fall back to the best available precision with the reason recorded."""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import ModelError

log = logging.getLogger("kiln.build")

PRECISIONS = ("FP32", "FP16", "BF16", "INT8")
INT8_LAYERS = ("QConv", "QMatMul", "QGemm", "QAdd", "QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger",
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
    """Whether this CPU computes FP16/BF16 natively (flags in /proc/cpuinfo; absent file: no)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    return {"FP16": bool({"avx512_fp16", "amx_fp16"} & flags), "BF16": bool({"avx512_bf16", "amx_bf16"} & flags)}


def requested(layer, options: PrecisionOptions) -> str:
    for pattern, kind in options.layer_precisions.items():
        if fnmatch.fnmatchcase(layer.name, pattern):
            return kind
    if layer.op_type in INT8_LAYERS or layer.op_type in QDQ_OPS:
        return "INT8"
    if options.int8 and (layer.op_type in INT8_CAPABLE or _float_out(layer)):
        return "INT8"   # --int8 allows INT8 everywhere, as TensorRT's flag does; kiln says where it was not given
    if options.bf16 or options.fp16:
        return "BF16" if options.bf16 and not options.fp16 else "FP16"
    return "FP32"


def _float_out(layer) -> bool:
    return any(np.dtype(t.dtype).kind == "f" for t in layer.outputs)


def granted(layer) -> str:
    if layer.op_type in INT8_LAYERS or layer.op_type in QDQ_OPS:
        return "INT8"
    dtypes = [np.dtype(t.dtype) for t in layer.outputs]
    if any(d in (np.dtype(np.int8), np.dtype(np.uint8)) for d in dtypes):
        return "INT8"
    if any(d == np.float16 for d in dtypes):
        return "FP16"
    return "FP32"


def reason(layer, want: str, got: str, support: dict[str, bool]) -> str:
    if want == got:
        return ""
    if want in ("FP16", "BF16"):
        why = f"this CPU has no native {want} arithmetic" if not support.get(want) else \
            f"kiln has no {want} kernel for {layer.op_type}"
        return f"{why}; {got} kernels are used (kiln's CPU kernels compute in FP32 or INT8)"
    if want == "INT8" and got == "FP32":
        if layer.op_type in INT8_CAPABLE:
            return "no input scale: INT8 needs Q/DQ around the layer or calibration (--int8 --calib)"
        return f"no INT8 kernel for {layer.op_type}"
    if want == "FP32" and got == "INT8":
        return "the model's Q/DQ nodes fix this layer to INT8"
    return f"{want} is not available for {layer.op_type}"


def assign(layers: list, options: PrecisionOptions) -> list:
    """Every layer (and every region's inner layer) with requested/granted precision and the reason."""
    support = cpu_reduced_float_support()
    out = []
    for layer in layers:
        inner = tuple(_assign_one(i, options, support) for i in layer.inner)
        one = _assign_one(layer, options, support) if not layer.inner else layer
        out.append(dataclasses.replace(one, inner=inner) if inner else one)
    return out


def _assign_one(layer, options: PrecisionOptions, support: dict[str, bool]):
    if layer.op_type in ("Reformat", "Constant", "Region"):
        return layer
    want, got = requested(layer, options), granted(layer)
    why = reason(layer, want, got, support)
    if why:
        if options.constraints == "obey" and want != "FP32":
            raise ModelError(f"layer '{layer.name}' ({layer.op_type}): --precision-constraints obey asks for {want}, "
                             f"which kiln cannot give: {why}")
        log.info("Layer %s: requested %s, granted %s: %s", layer.name, want, got, why)
    return dataclasses.replace(layer, precision=got, requested_precision=want, precision_reason=why)
