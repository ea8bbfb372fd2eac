"""The tactic registry: candidate kernels per op type, tactic sources, and the candidates for a layer."""
from __future__ import annotations

from kiln.errors import Error
from kiln.tactics.attention_bf16 import Bf16AttentionTactic
from kiln.tactics.attention_c import AttentionBf16Tactic, AttentionTactic
from kiln.tactics.base import LayerView, Tactic
from kiln.tactics.codegen import SINGLE_OPS, CodegenPointWiseBf16Tactic, CodegenPointWiseTactic
from kiln.tactics.conv1x1 import Conv1x1GemmTactic
from kiln.tactics.copy_c import COPY_OPS, CopyRowsBf16Tactic, CopyRowsTactic
from kiln.tactics.conv_direct import DirectConv1dTactic, DirectConvTactic
from kiln.tactics.conv_planes import Conv1x1PlanesBf16Tactic, Conv1x1PlanesTactic
from kiln.tactics.depthwise_c import DepthwiseConvBf16Tactic, DepthwiseConvTactic
from kiln.tactics.dqgemm_c import (DynamicQConvAmxTactic, DynamicQConvTactic, DynamicQLinearGemmAmxTactic,
                                    DynamicQLinearGemmTactic)
from kiln.tactics.gemm_amx import Conv1x1GemmAmxTactic, DirectConvAmxTactic, MatMulGemmAmxTactic
from kiln.tactics.gemm_bf16 import (Conv1x1GemmBf16Tactic, DirectConv1dBf16Tactic, DirectConvBf16Tactic,
                                   MatMulGemmBf16Tactic)
from kiln.tactics.groupnorm_c import (NORMS, GroupNormBf16Tactic, GroupNormNhwcBf16Tactic, GroupNormNhwcTactic,
                                     GroupNormTactic)
from kiln.tactics.layernorm_c import LayerNormBf16Tactic, LayerNormTactic, QuantizedLayerNormTactic
from kiln.tactics.lookup_c import LookupTableTactic
from kiln.tactics.matmul_c import MatMulGemmTactic
from kiln.tactics.onednn_conv import (OneDnnBf16Conv1dTactic, OneDnnBf16ConvTactic, OneDnnBf16Deconv1dTactic,
                                     OneDnnBf16DeconvTactic, OneDnnConv1dTactic, OneDnnConvTactic, OneDnnDeconv1dTactic,
                                     OneDnnDeconvTactic, OneDnnFp16Conv1dTactic, OneDnnFp16ConvTactic,
                                     OneDnnFp16Deconv1dTactic, OneDnnFp16DeconvTactic)
from kiln.tactics.onednn_int8 import OneDnnInt8Conv1dTactic, OneDnnInt8ConvTactic, OneDnnInt8LinearTactic
from kiln.tactics.onednn_prim import PrimitiveInt8ConvTactic
from kiln.tactics.onednn_prim_float import PrimitiveBf16ConvTactic, PrimitiveConvTactic
from kiln.tactics.onednn_prim_linear import (PrimitiveBf16LinearTactic, PrimitiveInt8LinearTactic,
                                             PrimitiveLinearTactic)
from kiln.tactics.onednn_linear import OneDnnBf16LinearTactic, OneDnnFp16LinearTactic, OneDnnLinearTactic
from kiln.tactics.onnxruntime_source import OnnxRuntimeLayerTactic
from kiln.tactics.onnxruntime_source import available as onnxruntime_available
from kiln.tactics.pool_c import POOL_OPS, NhwcPoolBf16Tactic, NhwcPoolTactic, QuantizedPoolTactic
from kiln.tactics.quant_c import QuantizeLinearTactic
from kiln.tactics.qdepthwise_c import QDepthwiseConvTactic
from kiln.tactics.qgemm_act_c import QActMatMulTactic
from kiln.tactics.qgemm_amx import QConvDirectAmxTactic, QConvGemmAmxTactic, QLinearGemmAmxTactic
from kiln.tactics.qgemm_c import QConvDirectTactic, QConvGemmTactic, QLinearGemmTactic
from kiln.tactics.reference import BF16_OPS, Bf16ReferenceTactic, ReferenceTactic
from kiln.tactics.resize_c import (InterpolateResizeBf16Tactic, InterpolateResizeTactic, NhwcResizeBf16Tactic,
                                   NhwcResizeTactic, QuantizedResizeTactic)
from kiln.tactics.rotary_c import RotaryBf16Tactic, RotaryTactic
from kiln.tactics.shuffle_c import PermuteCopyBf16Tactic, PermuteCopyTactic
from kiln.tactics.softmax_c import SOFTMAX_OPS, QuantizedSoftmaxTactic, SoftmaxBf16Tactic, SoftmaxTactic
from kiln.tactics.winograd import WinogradBf16Tactic, WinogradConvTactic


_CONV_TACTICS: list[Tactic] = [Conv1x1GemmTactic(), DepthwiseConvTactic(), PrimitiveConvTactic(), OneDnnConvTactic(),
                               DirectConvTactic(), WinogradConvTactic(4), WinogradConvTactic(2),
                               DepthwiseConvBf16Tactic(), PrimitiveBf16ConvTactic(), OneDnnBf16ConvTactic(),
                               Conv1x1GemmBf16Tactic(), DirectConvBf16Tactic(), Conv1x1GemmAmxTactic(),
                               DirectConvAmxTactic(), WinogradBf16Tactic(), OneDnnFp16ConvTactic(),
                               Conv1x1PlanesTactic(), Conv1x1PlanesBf16Tactic(), DirectConv1dTactic(),
                               OneDnnConv1dTactic(), DirectConv1dBf16Tactic(), OneDnnBf16Conv1dTactic(),
                               OneDnnFp16Conv1dTactic()]
_PRODUCT_TACTICS: list[Tactic] = [PrimitiveLinearTactic(), OneDnnLinearTactic(), MatMulGemmTactic(),
                                  PrimitiveBf16LinearTactic(), OneDnnBf16LinearTactic(), MatMulGemmBf16Tactic(),
                                  MatMulGemmAmxTactic(), OneDnnFp16LinearTactic()]
_LAYER_TACTICS: dict[str, list[Tactic]] = {
    "Conv": _CONV_TACTICS,
    "ConvTranspose": [OneDnnDeconvTactic(), OneDnnBf16DeconvTactic(), OneDnnFp16DeconvTactic(), OneDnnDeconv1dTactic(),
                      OneDnnBf16Deconv1dTactic(), OneDnnFp16Deconv1dTactic()],
    "Gemm": _PRODUCT_TACTICS,
    "MatMul": _PRODUCT_TACTICS,
    "PointWise": [LookupTableTactic(), CodegenPointWiseTactic(), CodegenPointWiseBf16Tactic()],
    "BatchNormalization": [CodegenPointWiseTactic(), CodegenPointWiseBf16Tactic()],
    "Resize": [NhwcResizeTactic(), NhwcResizeBf16Tactic(), InterpolateResizeTactic(), InterpolateResizeBf16Tactic()],
    "LayerNormalization": [LayerNormTactic(), LayerNormBf16Tactic()],
    "RMSNormalization": [LayerNormTactic(), LayerNormBf16Tactic()],
    "SkipLayerNormalization": [LayerNormTactic(), LayerNormBf16Tactic()],
    "QConv": [PrimitiveInt8ConvTactic(), OneDnnInt8ConvTactic(), OneDnnInt8Conv1dTactic(), QConvGemmTactic(),
              QConvDirectTactic(), QConvGemmAmxTactic(), QConvDirectAmxTactic(), QDepthwiseConvTactic()],
    "QGemm": [PrimitiveInt8LinearTactic(), OneDnnInt8LinearTactic(), QLinearGemmTactic(), QLinearGemmAmxTactic()],
    "QMatMul": [PrimitiveInt8LinearTactic(), OneDnnInt8LinearTactic(), QLinearGemmTactic(), QLinearGemmAmxTactic(),
                QActMatMulTactic()],
    "DynamicQMatMul": [DynamicQLinearGemmTactic(), DynamicQLinearGemmAmxTactic()],
    "DynamicQConv": [DynamicQConvTactic(), DynamicQConvAmxTactic()],
    "QAdd": [CodegenPointWiseTactic()],   # its program: DQ, DQ, Add, Q
    "QSoftmax": [QuantizedSoftmaxTactic()],
    "QAveragePool": [QuantizedPoolTactic()],
    "QResize": [QuantizedResizeTactic()],
    "QConcat": [CopyRowsTactic()],   # its inputs' tables applied as it copies
    "QLayerNorm": [QuantizedLayerNormTactic()],
    "QuantizeLinear": [QuantizeLinearTactic()],
    "DequantizeLinear": [QuantizeLinearTactic()],
    "Attention": [AttentionTactic(), AttentionBf16Tactic(), Bf16AttentionTactic()],
    "RotaryEmbedding": [RotaryTactic(), RotaryBf16Tactic()],
}


def _merged(*tables: dict[str, list[Tactic]]) -> dict[str, list[Tactic]]:
    """One candidate list per op type, an op's lists joined in table order: an op in two tables (a spatial
    ReduceMean is a global pool and also a bf16 reference op) keeps both tables' tactics, where repeated keys in
    one dict literal would silently keep only the last."""
    merged: dict[str, list[Tactic]] = {}
    for table in tables:
        for op, tactics in table.items():
            merged.setdefault(op, []).extend(tactics)
    return merged


# Candidates per op type in preference order, then the generic ones every op may use. The autotuner times them.
REGISTRY: dict[str, list[Tactic]] = _merged(
    _LAYER_TACTICS,
    {op: [NhwcPoolTactic(), NhwcPoolBf16Tactic()] for op in POOL_OPS},
    {op: [GroupNormTactic(), GroupNormBf16Tactic(), GroupNormNhwcTactic(), GroupNormNhwcBf16Tactic()] for op in NORMS},
    {op: [SoftmaxTactic(), SoftmaxBf16Tactic()] for op in SOFTMAX_OPS},
    {op: [CodegenPointWiseBf16Tactic()] for op in SINGLE_OPS},
    {op: ([PermuteCopyTactic(), PermuteCopyBf16Tactic()] if op == "Shuffle" else []) + [Bf16ReferenceTactic()]
     + ([CopyRowsTactic(), CopyRowsBf16Tactic()] if op in COPY_OPS else []) for op in BF16_OPS})
GENERIC: list[Tactic] = [ReferenceTactic(), OnnxRuntimeLayerTactic()]
TACTICS_BY_NAME: dict[str, Tactic] = {t.name: t for t in [*GENERIC, *(t for ts in REGISTRY.values() for t in ts)]}
ALL_SOURCES = ("onednn", "torch-onednn", "kiln", "codegen", "torch", "onnxruntime", "openvino")


def available_sources() -> frozenset[str]:
    from kiln.tactics import codegen, onednn_prim, openvino_source  # noqa: F811

    present = {"onnxruntime": onnxruntime_available(), "openvino": openvino_source.available(),
               "codegen": codegen.available(), "onednn": onednn_prim.available()}
    return frozenset(s for s in ALL_SOURCES if present.get(s, True))


def parse_sources(spec: str | None) -> frozenset[str]:
    """trtexec's --tacticSources spelling: "+onnxruntime,-torch-onednn" edits the default set; bare names replace it."""
    sources = set(available_sources())
    if not spec:
        return frozenset(sources)
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if all(s[0] not in "+-" for s in items):
        sources = set()
    for item in items:
        sign, name = (item[0], item[1:]) if item[0] in "+-" else ("+", item)
        name = name.lower()
        if name not in ALL_SOURCES:
            raise Error(f"unknown tactic source '{name}'; known sources: {', '.join(ALL_SOURCES)}")
        if sign == "+" and name not in available_sources():
            raise Error(f"tactic source '{name}' is not available on this machine (is the package installed?)")
        (sources.add if sign == "+" else sources.discard)(name)
    return frozenset(sources)   # layers no chosen source supports fall back to torch's reference kernels


def reduced_precisions(tactic: Tactic) -> frozenset[str]:
    """The reduced precision(s) a tactic computes a layer in instead of its native one (its types'), e.g. BF16 for
    a float32 layer; empty for tactics computing in the native precision."""
    return getattr(tactic, "reduced_precisions", frozenset())


def offers(layer: LayerView, sources: frozenset[str] | None, precision: str) -> bool:
    """Whether an enabled tactic computes `layer` in the reduced `precision` (asked by the precision stage)."""
    return any(precision in reduced_precisions(t) and (sources is None or t.source in sources) and t.supports(layer)
               for t in REGISTRY.get(layer.op_type, []) + GENERIC)


def candidates(layer: LayerView, sources: frozenset[str] | None = None, precision: str | None = None) -> list[Tactic]:
    """The tactics that can run `layer`, best first (registry order), from the enabled `sources` (torch's reference
    kernels when none of them can): those computing in the granted reduced `precision` where one is granted,
    else those computing in the layer's native precision."""
    found = [t for t in REGISTRY.get(layer.op_type, []) + GENERIC
             if (precision in reduced_precisions(t) if precision else not reduced_precisions(t)) and t.supports(layer)]
    if not found and precision:
        return candidates(layer, sources)
    if sources is not None:
        found = [t for t in found if t.source in sources] or [t for t in found if t.source == "torch"]
    return found
