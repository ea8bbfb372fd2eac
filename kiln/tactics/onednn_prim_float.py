"""oneDNN floating-point convolution as a primitive of kiln's own (source "onednn"), in FP32 or BF16: made once per
input shape at load (kiln/native/csrc/onednn.c), the weights reordered then into its kernel's layout (rounded to
bf16 for BF16), each call only its data pointers and an execute. The layers torch's `_convolution_pointwise`
takes (kiln.tactics.onednn_conv), on channel-major activations, and more of them fused: ONNX's asymmetric pads
as they are (no padded copy), every activation oneDNN has an algorithm for after a residual (not only ReLU), and a
BF16 call's residual of another type than its output added from its own buffer in FP32 (torch's call rounds it to
the compute type, so kiln's torch tactic adds it after the call, in a second pass).

BF16 reads bf16 activations (an input the plan stores FP32 is rounded as it is made channel-major) and writes the
output as the plan stores it, FP32 or bf16 (kiln.tactics.storage); the residual joins as oneDNN's sum post-op where
it has the output's type (accumulated in its dead buffer: `into_input`), else as a binary add."""
from __future__ import annotations

from kiln.tactics.base import Kernel, LayerView
from kiln.tactics.gemm_c import tensor_address
from kiln.tactics.onednn_conv import Bf16Variant, OneDnnBf16ConvTactic, OneDnnConvTactic
from kiln.tactics.onednn_prim import (ConvCall, OwnPrimitive, available, eltwise, executor, float_fields, geometry,
                                      output_layout, summing_kernel)


class PrimitiveConvTactic(OwnPrimitive, OneDnnConvTactic):
    name = "onednn.conv2d_primitive"
    library_fallback = OneDnnConvTactic()

    def supports(self, layer: LayerView) -> bool:
        shapes = layer.input_shapes
        bias_known = len(shapes) < 3 or shapes[2] is None or 2 in layer.const_inputs
        return (super().supports(layer) and bias_known and eltwise(layer.attrs.get("activation")) is not None
                and available())

    def prepare(self, layer: LayerView) -> Kernel:
        fields, x_dtype, y_dtype, residual = float_fields(layer, self.compute_dtype)
        w = layer.const_inputs[1].float().contiguous()   # rounded to bf16 by oneDNN's reorder into its layout
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.float().contiguous()

        def make_call(shape: tuple[int, ...], _any_rows: bool) -> ConvCall:
            return ConvCall(*geometry(layer, shape), *fields, None, w.data_ptr(), tensor_address(bias))

        execute = executor(layer, "conv", make_call, lambda shape: output_layout(layer, shape), y_dtype, x_dtype)
        return summing_kernel(execute, None, residual)


class PrimitiveBf16ConvTactic(Bf16Variant, PrimitiveConvTactic):
    name = "onednn.conv2d_primitive_bf16"
    library_fallback = OneDnnBf16ConvTactic()
