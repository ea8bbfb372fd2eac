"""oneDNN inner product through torch: a Gemm or MatMul whose second operand is a constant matrix, the weight
prepacked once into oneDNN's blocked layout, bias and activation fused (`torch.ops.mkldnn._linear_pointwise`).

A classifier's 2048x1000 FC inside ResNet-50, its weights coming from memory: 0.27 ms against 0.43 ms for
torch's `linear` on the plain matrix (0.08 against 0.13 ms with hot caches). The BF16 variant computes in bfloat16
with FP32 tensors in and out (conversions fused into the kernel), the FP16 variant in float16 on AVX512-FP16."""
from __future__ import annotations

import math

import torch

from kiln.tactics.base import LINEAR, Kernel, LayerView, has_residual
from kiln.tactics.onednn_conv import Bf16Variant, Fp16Variant, casts, finisher, fused_unary, sums_in_compute_type


def linear_weight(layer: LayerView) -> torch.Tensor:
    """The [N, K] matrix oneDNN wants: Gemm's B as stored when transB, else (and for MatMul) B transposed."""
    b = layer.const_inputs[1]
    return b if layer.op_type == "Gemm" and layer.attrs.get("transB", 0) else b.t()


def linear_bias(layer: LayerView, n: int) -> tuple[bool, torch.Tensor | None]:
    """(usable, bias as a length-N vector): a constant per output column, or nothing."""
    if len(layer.input_shapes) < 3 or layer.input_shapes[2] is None:
        return True, None
    c = layer.const_inputs.get(2)
    if c is None or c.dtype != torch.float32 or tuple(c.shape) not in ((n,), (1, n)):
        return False, None
    return True, c.reshape(n)


def by_constant_matrix(layer: LayerView) -> bool:
    """A float32 MatMul (or Gemm without transA/alpha/beta) of an activation by a constant 2-D matrix, with a
    per-column constant bias or none and a residual of the output's shape or none: a linear layer, whichever
    library runs it."""
    if layer.op_type not in ("Gemm", "MatMul") or layer.domain not in ("", "ai.onnx"):
        return False
    x, w = layer.input_shapes[0], layer.const_inputs.get(1)
    if x is None or w is None or w.dim() != 2 or w.dtype != torch.float32 or layer.input_dtypes[0] != "float32":
        return False
    a = layer.attrs
    if layer.op_type == "Gemm" and (len(x) != 2 or a.get("transA", 0) or a.get("alpha", 1.0) != 1.0
                                    or a.get("beta", 1.0) != 1.0):
        return False
    n = linear_weight(layer).shape[0]
    return len(x) >= 2 and linear_bias(layer, n)[0] and (not has_residual(layer) or (
        tuple(layer.input_shapes[3]) == (*x[:-1], n) and layer.input_spec(3) == (*layer.input_spec(0)[:-1], n)))


class OneDnnLinearTactic:
    name = "onednn.linear_prepacked"
    source = "torch-onednn"
    compute_dtype = torch.float32

    def supports(self, layer: LayerView) -> bool:
        return by_constant_matrix(layer) and torch.backends.mkldnn.is_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        dtype = self.compute_dtype
        to_compute, _ = casts(dtype)
        w = linear_weight(layer).contiguous().to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, math.prod(layer.input_shapes[0][:-1]))
        bias = linear_bias(layer, w.shape[0])[1]
        bias = None if bias is None else bias.to(dtype)
        spec = layer.attrs.get("activation")
        fused = fused_unary(spec)
        unary, scalars, algorithm = fused if fused else ("none", [], "")
        post = None if (not spec or fused is not None) else spec
        linear = torch.ops.mkldnn._linear_pointwise

        if has_residual(layer):
            return self.residual_kernel(layer, packed, bias, to_compute)
        finish = finisher(post, layer.output_dtypes[0])

        def run(xs):
            return finish(linear(to_compute(xs[0].contiguous()), packed, bias, unary, scalars, algorithm or ""))
        return run

    def residual_kernel(self, layer: LayerView, packed, bias, to_compute) -> Kernel:
        """x·W + bias + residual, then the activation (after oneDNN's call). The sum is oneDNN's binary "add"
        post-op where that rounds nothing the plan keeps (`sums_in_compute_type`); otherwise the product is rounded
        alone and the residual added in FP32, as when the Add was a layer of its own: a budget keeping the
        residual's producer or the output in FP32 means just that."""
        finish = finisher(layer.attrs.get("activation"), layer.output_dtypes[0])
        linear = torch.ops.mkldnn._linear_pointwise
        if sums_in_compute_type(layer, self.compute_dtype):
            def run(xs):
                return finish(linear.binary(to_compute(xs[0].contiguous()), to_compute(xs[3].contiguous()), packed,
                                            bias, "add"))
            return run

        def run_then_add(xs):
            product = linear(to_compute(xs[0].contiguous()), packed, bias, "none", [], "")
            return finish(product.float() + xs[3].float())
        return run_then_add


class OneDnnBf16LinearTactic(Bf16Variant, OneDnnLinearTactic):
    name = "onednn.linear_prepacked_bf16"


class OneDnnFp16LinearTactic(Fp16Variant, OneDnnLinearTactic):
    name = "onednn.linear_prepacked_fp16"
