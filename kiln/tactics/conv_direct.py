"""Direct convolution on kiln's GEMM micro-kernel (kiln.tactics.gemm_c.kiln_conv): channel-major (NHWC)
activations, any kernel size, stride and padding (dilation 1, one group). Each output pixel is a GEMM row whose
window is read in place, one contiguous segment of kernel-width x channels per kernel row; bias, residual and
the activation are applied as the output is written, like the 1x1 tactic.

It competes with oneDNN for what Winograd and the 1x1 GEMM do not take: strided 3x3 layers, 7x7 maps, stems.
Against oneDNN through torch a call costs ~4 µs instead of ~28 µs of descriptor set-up, which decides small
layers; on ResNet-50's it runs within 2 % of oneDNN at 56x56 and 28x28 and 10-20 % slower where 9 MB of
weights stream through (512 channels) or a stem's 3 input channels make short segments. Listed after oneDNN,
it must be the autotuner's margin faster to be chosen, and oneDNN stays the untimed default. The 1-D variant
(DirectConv1dTactic) is listed before oneDNN's 1-D convolution, which it beats on every speech shape measured.
"""
from __future__ import annotations

import ctypes

import torch

from kiln import native
from kiln.tactics import gemm_c
from kiln.tactics.base import (HWC, LINEAR, Kernel, LayerView, RowMajor1d, batch_dynamic_only, conv1d_as_2d,
                               has_residual, storage_dtype)
from kiln.tactics.reformat import to_format

DIRECT_TACTIC = "kiln.conv2d_direct_gemm_nhwc"


def conv_geometry(layer: LayerView) -> tuple[int, int, int, int, int, int, int, int]:
    """(kh, kw, sh, sw, pad top, pad left, out h, out w)."""
    _, _, h, w = layer.input_shapes[0]
    kh, kw = layer.const_inputs[1].shape[2:]
    sh, sw = layer.attrs.get("strides") or [1, 1]
    pt, pl, pb, pr = layer.attrs.get("pads") or [0, 0, 0, 0]
    return kh, kw, sh, sw, pt, pl, (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1


def pack_segments(weight: torch.Tensor) -> torch.Tensor:
    """[kh, kw * c, cout] -> kiln_conv's panels: kernel rows one after another, [cout/32][kh * kw * c][32]."""
    kh, seg, cout = weight.shape
    return gemm_c.pack_weights(weight.reshape(kh * seg, cout))


class DirectConvTactic:
    name = DIRECT_TACTIC
    source = "kiln"
    needs_c_compiler = True
    entry_point = "kiln_conv"                       # the BF16 variant (kiln.tactics.gemm_bf16) swaps these two
    pack = staticmethod(pack_segments)
    io_flags = staticmethod(gemm_c.no_io_flags)
    leaves_1x1 = True                               # unpadded 1x1 kernels: the 1x1 GEMM tactic's

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or 1 not in layer.const_inputs:
            return False
        a, w, x = layer.attrs, layer.const_inputs[1], layer.input_shapes[0]
        if x is None or len(x) != 4 or layer.input_dtypes[0] != "float32" or w.dim() != 4:
            return False
        if a.get("group", 1) != 1 or any(d != 1 for d in a.get("dilations") or [1, 1]):
            return False
        if self.leaves_1x1 and tuple(w.shape[2:]) == (1, 1) and not any(a.get("pads") or [0]):
            return False   # the 1x1 GEMM tactic's layer
        kh, kw, sh, sw, pt, pl, oh, ow = conv_geometry(layer)
        if oh < 1 or ow < 1 or min(pt, pl) < 0 or not gemm_c.epilogue_inputs_fit(layer, (x[0], w.shape[0], oh, ow)):
            return False
        return batch_dynamic_only(layer) and native.available()   # the batch is read per call

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("gemm")
        n, c, h, w = layer.input_shapes[0]
        weight = layer.const_inputs[1]
        cout = weight.shape[0]
        kh, kw, sh, sw, pt, pl, oh, ow = conv_geometry(layer)
        packed = self.pack(weight.permute(2, 3, 1, 0).reshape(kh, kw * c, cout).float())
        conv = getattr(lib, self.entry_point)
        bias = gemm_c.pad_bias(layer.const_inputs.get(2), cout)
        act = gemm_c.gemm_activation(layer.attrs.get("activation"))   # None: applied after the kernel
        call = gemm_c.ConvCall(packed.data_ptr(), gemm_c.tensor_address(bias), h, w, c, kh, kw, sh, sw, pt, pl, oh, ow,
                               act or gemm_c.Act(), cout, self.io_flags(layer))
        call_ptr = ctypes.addressof(call)

        def launch(x, out, res):
            conv(call_ptr, x.data_ptr(), out.data_ptr(), None if res is None else res.data_ptr(), x.shape[0])
        run = gemm_c.nhwc_kernel(launch, (n, cout, oh, ow), layer.attrs.get("activation"), has_residual(layer),
                                 storage_dtype(layer.output_dtypes[0]), fused=act is not None)
        run.constants = (packed, bias, call)   # read through raw pointers
        return run


class DirectConv1dTactic(RowMajor1d, DirectConvTactic):
    """A 1-D convolution (wav2vec2's feature encoder, Whisper's front end, TTS and speech models) on the direct
    kernel as the 2-D one over [N, C, 1, L]: row-major in and out, the input and residual made channel-major and the
    output made row-major inside the call by the C reformat kernels. wav2vec2's 512 -> 512, k3 s2 layer on 3199
    frames: 13.3 ms against oneDNN's 1-D convolution's 18.3; its 1 -> 512, k10 s5 stem 0.9 against 4.1-8.5 ms
    (Zen 4, 2 threads, layouts included). Like the 2-D kernel it takes a dynamic batch only: an export with a
    dynamic frame count stays with oneDNN."""

    name = "kiln.conv1d_direct_gemm"
    leaves_1x1 = False   # the 1x1 GEMM tactic takes 2-D maps only

    def prepare(self, layer: LayerView) -> Kernel:
        planar = super().prepare(conv1d_as_2d(layer))

        def run(xs):
            maps = [x if x is None or i not in (0, 3) else to_format(x[:, :, None], HWC) for i, x in enumerate(xs)]
            return [to_format(y, LINEAR).squeeze(2) for y in planar(maps)]
        run.constants = planar.constants
        return run
