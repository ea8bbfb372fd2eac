"""1x1 convolution as kiln's own GEMM (kiln.tactics.gemm_c) on channel-major (NHWC) activations: each output
pixel is one row of the input, so the layer is [pixels x Cin] · [Cin x Cout], strides included (rows are read
in place), with bias, residual and the activation (gemm_c.gemm_activation) applied as the output is written.

Against oneDNN through torch the GEMM itself is about as fast, and a call costs ~3 µs instead of ~27 µs of
descriptor set-up inside ideep: that matters in ResNet-50, which has 36 of these layers. The autotuner decides.
"""
from __future__ import annotations

import ctypes

import torch

from kiln import native
from kiln.tactics import gemm_c
from kiln.tactics.base import HWC, Kernel, LayerView, batch_dynamic_only, has_residual, storage_dtype

CONV1X1_TACTIC = "kiln.conv2d_1x1_gemm_nhwc"


def _output_hw(layer: LayerView) -> tuple[int, int]:
    _, _, h, w = layer.input_shapes[0]
    sh, sw = layer.attrs.get("strides") or [1, 1]
    return (h - 1) // sh + 1, (w - 1) // sw + 1


class Conv1x1GemmTactic:
    name = CONV1X1_TACTIC
    source = "kiln"
    needs_c_compiler = True
    entry_point = "kiln_gemm"                       # the BF16 variant (kiln.tactics.gemm_bf16) swaps these two
    pack = staticmethod(gemm_c.pack_weights)
    io_flags = staticmethod(gemm_c.no_io_flags)

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or 1 not in layer.const_inputs:
            return False
        a, w, x = layer.attrs, layer.const_inputs[1], layer.input_shapes[0]
        if x is None or len(x) != 4 or layer.input_dtypes[0] != "float32" or w.dim() != 4:
            return False
        if tuple(w.shape[2:]) != (1, 1) or a.get("group", 1) != 1 or any(a.get("pads") or [0]):
            return False
        if not gemm_c.epilogue_inputs_fit(layer, (x[0], w.shape[0], *_output_hw(layer))):
            return False
        return batch_dynamic_only(layer) and native.available()   # the batch is read per call

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("gemm")
        n, c, h, w = layer.input_shapes[0]   # n at the profile's opt point; each call reads its own
        weight = layer.const_inputs[1]
        cout = weight.shape[0]
        sh, sw = layer.attrs.get("strides") or [1, 1]
        oh, ow = _output_hw(layer)
        packed = self.pack(weight.reshape(cout, c).t().float())
        act = gemm_c.gemm_activation(layer.attrs.get("activation"))   # None: applied after the kernel
        gemm = getattr(lib, self.entry_point)
        bias = gemm_c.pad_bias(layer.const_inputs.get(2), cout)
        call = gemm_c.GemmCall(packed.data_ptr(), gemm_c.tensor_address(bias), a_batch=h * w * c, row_width=ow,
                               col_step=sw * c, line_step=sh * w * c, c_batch=oh * ow * cout,
                               act=act or gemm_c.Act(), k=c, n=cout,
                               io=self.io_flags(layer))
        call_ptr, m = ctypes.addressof(call), oh * ow

        def launch(x, out, res):
            gemm(call_ptr, x.data_ptr(), out.data_ptr(), None if res is None else res.data_ptr(), x.shape[0], m)
        out_dtype = storage_dtype(layer.output_dtypes[0])
        run = gemm_c.nhwc_kernel(launch, (n, cout, oh, ow), layer.attrs.get("activation"), has_residual(layer),
                                 out_dtype, fused=act is not None)
        run.constants = (packed, bias, call)   # read through raw pointers
        if act is not None and not has_residual(layer):
            run.write_into = gemm_c.write_into_slice(run, call, gemm, (cout, oh, ow), out_dtype)
        return run
