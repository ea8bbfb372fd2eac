"""LayerNormalization, kiln's SkipLayerNormalization (the residual sum fused in) and RMSNormalization (T5's and
LLaMA's: no mean, no bias) over the trailing axes in C (kiln/native/csrc/layernorm.c): one pass per row for the
sum, two vectorized reductions in double (mean, then the centred variance, as torch and onnxruntime compute it;
RMSNormalization one, the mean of squares), one for the scaled output; OpenMP over rows. Instance and group
normalization are in kiln.tactics.groupnorm_c.

torch's layer_norm behind an Add costs BERT-base about 0.13 ms per 128x768 layer on this machine (two kernels,
an intermediate tensor, dispatch); the whole row fits in L1, so the fused loop runs at memory speed.
Dynamic leading axes are fine (rows are counted per call); the normalized size, scale and bias are fixed.
"""
from __future__ import annotations

import torch

from kiln import hardware, native
from kiln.tactics.base import LINEAR, STORED_FLOATS, Kernel, LayerView, bf16_io, storage_dtype

LAYERNORM_TACTIC = "kiln.layernorm_rows"
LN_SKIP_BF16 = 4   # layernorm.c's `io` bits above the storage bits (kiln.tactics.base.bf16_io): the skip in bf16,
LN_RMS = 8         # RMSNormalization


def _geometry(layer: LayerView) -> tuple[int, int] | None:
    """(normalized size, index of the scale input), or None when the layer is not a float32 LayerNorm over
    static trailing axes with constant per-element scale (and bias)."""
    skip = layer.op_type == "SkipLayerNormalization" and layer.domain == "kiln"
    onnx_op = layer.op_type in ("LayerNormalization", "RMSNormalization") and layer.domain in ("", "ai.onnx")
    if not (skip or onnx_op):
        return None
    first = 2 if skip else 1
    x = layer.input_shapes[0]
    if x is None or not x or len(layer.output_dtypes) != 1 or layer.attrs.get("stash_type", 1) != 1:
        return None
    acts = range(first)
    if any(layer.input_dtypes[i] not in STORED_FLOATS or layer.input_shapes[i] != x or i in layer.const_inputs
           for i in acts):
        return None
    axis = layer.attrs.get("axis", -1) % len(x)
    dynamic = [set(d) for d in layer.input_dynamic[:first]] if layer.input_dynamic else []
    if any(k >= axis for d in dynamic for k in d) or (skip and len(dynamic) == 2 and dynamic[0] != dynamic[1]):
        return None   # the normalized axes must be static, and x and skip vary alike
    n = 1
    for d in x[axis:]:
        n *= d
    params = [i for i in range(first, len(layer.input_shapes)) if layer.input_shapes[i] is not None]
    if first not in params or any(i not in layer.const_inputs or layer.const_inputs[i].numel() != n
                                  or layer.const_inputs[i].dtype != torch.float32 for i in params):
        return None
    return n, first


def _params(layer: LayerView) -> tuple[int, int, torch.Tensor, torch.Tensor | None, float]:
    """(normalized size, index of the scale input, scale, bias or None, epsilon), the FP32 vectors contiguous."""
    n, first = _geometry(layer)
    gamma = layer.const_inputs[first].reshape(-1).contiguous().float()
    beta = layer.const_inputs.get(first + 1)
    beta = None if beta is None else beta.reshape(-1).contiguous().float()
    return n, first, gamma, beta, float(layer.attrs.get("epsilon", 1e-5))


class LayerNormTactic:
    name = LAYERNORM_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        return _geometry(layer) is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        if layer.op_type == "RMSNormalization":
            return stored_rows_kernel(layer)   # its FP32 storage: the storage-aware loop, rows copied once
        lib = native.library("layernorm")
        n, first, gamma, beta, eps = _params(layer)

        def run(xs):
            x = xs[0].contiguous()
            skip = xs[1].contiguous() if first == 2 else None
            y = torch.empty_like(x, memory_format=torch.contiguous_format)
            lib.kiln_layernorm(x.data_ptr(), None if skip is None else skip.data_ptr(), gamma.data_ptr(),
                               None if beta is None else beta.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
            return [y]
        return run


class LayerNormBf16Tactic(LayerNormTactic):
    """The same rows with BF16 storage (`kiln_layernorm_bf16`): the input, the skip and the output are read and
    written in bf16 where the plan stores them so (kiln.tactics.storage), the statistics and the scaling computed
    in FP32. Offered with the BF16 kernels around it (native BF16 arithmetic), so a BF16 encoder's tensors stay
    bf16 from one GEMM to the next."""

    name = "kiln.layernorm_rows_bf16"
    reduced_precisions = frozenset({"BF16"})
    required_isa = hardware.BF16_ISA
    bf16_inputs = frozenset({0, 1})   # LayerNormalization's input 1 is its scale, a weight: never a tensor
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and hardware.has_any(hardware.BF16_ISA)

    def prepare(self, layer: LayerView) -> Kernel:
        return stored_rows_kernel(layer)


def stored_rows_kernel(layer: LayerView) -> Kernel:
    """`kiln_layernorm_bf16`: each of the input, the skip and the output FP32 or bf16 as the layer's dtypes say,
    RMSNormalization's statistic where the layer is one."""
    lib = native.library("layernorm")
    n, first, gamma, beta, eps = _params(layer)
    io = bf16_io(layer) | (LN_SKIP_BF16 if first == 2 and layer.input_dtypes[1] == "bfloat16" else 0) | \
        (LN_RMS if layer.op_type == "RMSNormalization" else 0)
    out_dtype = storage_dtype(layer.output_dtypes[0])

    def run(xs):
        x = xs[0].contiguous()
        skip = xs[1].contiguous() if first == 2 else None
        y = torch.empty(x.shape, dtype=out_dtype)
        lib.kiln_layernorm_bf16(x.data_ptr(), None if skip is None else skip.data_ptr(), gamma.data_ptr(),
                                None if beta is None else beta.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, io)
        return [y]
    run.constants = (gamma, beta)
    return run
