"""oneDNN convolution through torch: channel-major (NHWC) activations, weights prepacked once at load,
bias, residual sum and activation fused as post-ops (`torch.ops.mkldnn._convolution_pointwise`). The BF16 variant
computes in bfloat16 (AMX or AVX512-BF16) with FP32 tensors in and out: the conversions are fused into the kernel.
The FP16 variant likewise in float16 where the CPU has AVX512-FP16 (torch's oneDNN needs it for FP16 weights).
The 1-D tactics (Whisper's and wav2vec2's Conv1d) run the same kernel on [N, C, L] tensors viewed as [N, C, 1, L]:
row-major in and out, oneDNN reorders inside (Whisper-base's 512->512 k3 over 3000 frames, Zen 4, 2 threads:
23.9 ms FP32 against torch's conv1d 30.1 ms; 11.9 ms in BF16). ConvTranspose runs on oneDNN's deconvolution the same
ways (2-D channel-major, 1-D viewed), weights prepacked once and bias fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln import hardware
from kiln.ops.nn import _torch_pad, apply_activation
from kiln.ops.norm_resize import conv_transpose_geometry
from kiln.tactics.base import HWC, LINEAR, Kernel, LayerView, batch_dynamic_only, has_residual

# kiln activation -> (oneDNN unary attr, scalars from attrs, algorithm); None: applied after the kernel.
_UNARY = {
    "Relu": lambda a: ("relu", [], None),
    "Sigmoid": lambda a: ("sigmoid", [], None),
    "Tanh": lambda a: ("tanh", [], None),
    "HardSwish": lambda a: ("hardswish", [], None),
    "HardSigmoid": lambda a: ("hardsigmoid", [], None) if (a.get("alpha", 0.2), a.get("beta", 0.5)) == (1 / 6, 0.5) else None,
    "LeakyRelu": lambda a: ("leaky_relu", [a.get("alpha", 0.01)], None),
    "Clip": lambda a: ("hardtanh", [a.get("min", float("-inf")), a.get("max", float("inf"))], None),
    "Gelu": lambda a: ("gelu", [], a.get("approximate", "none")),
    "Swish": lambda a: ("swish", [], None) if a.get("alpha", 1.0) == 1.0 else None,
}
_BINARY_UNARY = {"Relu"}   # the only activation oneDNN accepts after a fused sum here


def fused_unary(spec):
    """(oneDNN unary attr, scalars, algorithm) for a fused activation spec, or None where oneDNN has none."""
    if not spec or spec["op"] not in _UNARY:
        return None
    return _UNARY[spec["op"]](spec.get("attrs", {}))


def casts(dtype: torch.dtype):
    """(to compute dtype, back to FP32) for a kernel computing in `dtype` on FP32 tensors; identities for FP32."""
    if dtype == torch.float32:
        return (lambda x: x), (lambda y: y)
    return (lambda x: x.to(dtype)), (lambda y: y.float())


def finisher(post: dict | None, out_dtype: str):
    """The last step of a oneDNN kernel: an activation oneDNN could not fuse (in FP32), then the result in the dtype
    the plan stores it in (bf16 where kiln.tactics.storage chose it, else FP32)."""
    out = torch.bfloat16 if out_dtype == "bfloat16" else torch.float32

    def finish(y: torch.Tensor) -> list[torch.Tensor]:
        if post:
            y = apply_activation(post, y.float())
        return [y if y.dtype == out else y.to(out)]
    return finish


def fp16_available() -> bool:
    """Native FP16 arithmetic here (AVX512-FP16) and a oneDNN that uses it (torch refuses FP16 weights elsewhere)."""
    return hardware.has_any(hardware.FP16_ISA) and torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_fp16_supported()


def bf16_available() -> bool:
    """Native BF16 arithmetic here (AVX512-BF16 or AMX) and a oneDNN that uses it."""
    return hardware.has_any(hardware.BF16_ISA) and torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()


class OneDnnWeightedTactic:
    """What oneDNN's convolution and deconvolution tactics share: the layout they read and write (channel-major in
    2-D, row-major for 1-D views) and the weights and bias in the compute dtype."""

    source = "torch-onednn"
    compute_dtype = torch.float32

    spatial_rank = 2
    layout = HWC

    def input_formats(self, layer: LayerView) -> list[str]:
        return [self.layout] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return self.layout

    def weights(self, layer: LayerView):
        """(weights, bias or None) in the compute dtype, and the cast of an activation to it."""
        to_compute, _ = casts(self.compute_dtype)
        bias = layer.const_inputs.get(2)
        return (layer.const_inputs[1].contiguous().to(self.compute_dtype),
                None if bias is None else bias.to(self.compute_dtype), to_compute)


class OneDnnConvTactic(OneDnnWeightedTactic):
    name = "onednn.conv2d_nhwc_prepacked"

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx"):
            return False
        shapes = layer.input_shapes
        return (len(shapes[0]) == 2 + self.spatial_rank and layer.input_dtypes[0] == "float32"
                and 1 in layer.const_inputs and torch.backends.mkldnn.is_available())

    def prepare(self, layer: LayerView) -> Kernel:
        a = layer.attrs
        w, bias, to_compute = self.weights(layer)
        pads, strides, dilations, groups = a["pads"], a["strides"], a["dilations"], a.get("group", 1)
        return self.kernel(layer, w, bias, pads, strides, dilations, groups, list(layer.input_shapes[0]), to_compute)

    def kernel(self, layer: LayerView, w, bias, pads, strides, dilations, groups, in_shape, to_compute) -> Kernel:
        """The 2-D oneDNN kernel on channel-major activations (`w` in the compute dtype, [O, I/g, kH, kW])."""
        a = layer.attrs
        begin, end = pads[:2], pads[2:]
        explicit_pad = None if begin == end else _torch_pad(pads)
        padding = begin if explicit_pad is None else [0, 0]
        if explicit_pad is not None:
            in_shape = [in_shape[0], in_shape[1], in_shape[2] + pads[0] + pads[2], in_shape[3] + pads[1] + pads[3]]
        packed = torch.ops.mkldnn._reorder_convolution_weight(w, padding, strides, dilations, groups, in_shape)
        spec = a.get("activation")
        with_residual = has_residual(layer)
        fused = fused_unary(spec)
        if with_residual and spec and spec["op"] not in _BINARY_UNARY:
            fused = None
        post = None if (not spec or fused is not None) else spec
        unary, scalars, alg = fused if fused else (None if with_residual else "none", [], None)
        conv, into = torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._convolution_pointwise_
        last = torch.channels_last

        def padded(x):
            return x if explicit_pad is None else F.pad(x, explicit_pad).contiguous(memory_format=last)

        finish = finisher(post, layer.output_dtypes[0])
        if with_residual and not sums_in_compute_type(layer, self.compute_dtype):
            then_add = finisher(spec, layer.output_dtypes[0])

            def run_then_add(xs):
                """The residual added in FP32 as stored: oneDNN's reduced-precision call would round it (a budget
                keeping the residual's producer or this output in FP32 means just that), then the activation."""
                product = conv(padded(to_compute(xs[0])), packed, bias, padding, strides, dilations, groups, "none",
                               [], "")
                return then_add(product.float() + xs[3].float())
            return run_then_add

        def run(xs):
            x = padded(to_compute(xs[0]))
            if with_residual:
                return finish(conv.binary(x, to_compute(xs[3]), packed, bias, padding, strides, dilations, groups,
                                          "add", 1.0, unary, scalars, alg))
            return finish(conv(x, packed, bias, padding, strides, dilations, groups, unary, scalars, alg))

        def run_into_residual(xs):
            """The residual as oneDNN's sum post-op: accumulate into its (dead) buffer, no new output to allocate
            and one stream less to move; the executor calls this only when no live tensor shares that buffer."""
            residual = xs[3]
            if residual.dtype != torch.float32 or not residual.is_contiguous(memory_format=last):
                return run(xs)
            return finish(into.binary(residual, padded(xs[0]), packed, bias, padding, strides, dilations, groups,
                                      "add", 1.0, unary, scalars, alg))
        if with_residual and self.compute_dtype == torch.float32:   # the sum post-op writes the residual's FP32 buffer
            run.into_input = (3, run_into_residual)
        return run


def sums_in_compute_type(layer: LayerView, compute_dtype: torch.dtype) -> bool:
    """Whether oneDNN's sum post-op rounds nothing the plan keeps: in FP32, or in BF16 with the residual and the
    output stored bf16 (a reduced-precision call reads and writes only its compute type; FP16's tensors are stored
    FP32, so an FP16 call's residual is always added after it)."""
    return compute_dtype == torch.float32 or \
        (compute_dtype == torch.bfloat16 and layer.input_dtypes[3] == layer.output_dtypes[0] == "bfloat16")


class OneDnnConv1dTactic(OneDnnConvTactic):
    """A 1-D convolution on the 2-D kernel: [N, C, L] viewed as [N, C, 1, L] (row-major: oneDNN reorders inside and
    writes channel-major, copied back to row-major), weights [O, I/g, 1, K]."""

    name = "onednn.conv1d_prepacked"
    spatial_rank = 1
    layout = LINEAR

    def kernel(self, layer: LayerView, w, bias, pads, strides, dilations, groups, in_shape, to_compute) -> Kernel:
        planar = super().kernel(layer, w[:, :, None], bias, [0, pads[0], 0, pads[1]], [1, *strides], [1, *dilations],
                                groups, [*in_shape[:2], 1, *in_shape[2:]], to_compute)

        def run(xs):
            ys = planar([x if x is None else x[:, :, None] for x in xs])
            return [y.squeeze(2).contiguous() for y in ys]
        return run


class OneDnnDeconvTactic(OneDnnWeightedTactic):
    """ConvTranspose on oneDNN's deconvolution (`torch.ops.mkldnn._convolution_transpose_pointwise`): channel-major
    activations, weights [C, O/g, kH, kW] prepacked once, bias and activation fused (one oneDNN lacks runs after it,
    in FP32). ONNX's begin and end pads map onto oneDNN's padding (the begin crop) and output padding (what the end
    crop gives back); a geometry where that output padding would be negative or reach the stride is not taken
    (torch's reference runs it)."""

    name = "onednn.deconv2d_nhwc_prepacked"

    def geometry(self, layer: LayerView):
        """(padding, output padding, end trim, strides, dilations) for oneDNN, or None where ONNX's geometry has
        no such form. The end trim crops what oneDNN's output padding cannot (an end pad above the begin pad)."""
        x_shape, w_shape = layer.input_shapes[0], layer.input_shapes[1]
        strides, dilations, out_pad, pads = conv_transpose_geometry(layer.attrs, list(x_shape[2:]), list(w_shape[2:]))
        n = len(strides)
        begin, end = pads[:n], pads[n:]
        give_back = [o + b - e for o, b, e in zip(out_pad, begin, end)]
        if any(g >= max(s, d) for g, s, d in zip(give_back, strides, dilations)):
            return None
        return begin, [max(g, 0) for g in give_back], [max(-g, 0) for g in give_back], strides, dilations

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "ConvTranspose" or layer.domain not in ("", "ai.onnx"):
            return False
        shapes = layer.input_shapes
        bias_known = len(shapes) < 3 or shapes[2] is None or 2 in layer.const_inputs
        return (len(shapes[0]) == 2 + self.spatial_rank and layer.input_dtypes[0] == "float32" and bias_known
                and 1 in layer.const_inputs and torch.backends.mkldnn.is_available() and batch_dynamic_only(layer)
                and self.geometry(layer) is not None)   # pads from auto_pad/output_shape follow the input's size

    def prepare(self, layer: LayerView) -> Kernel:
        w, bias, to_compute = self.weights(layer)
        geometry = (*self.geometry(layer), layer.attrs.get("group", 1))
        return self.kernel(layer, w, bias, geometry, list(layer.input_shapes[0]), to_compute)

    def kernel(self, layer: LayerView, w, bias, geometry, in_shape, to_compute) -> Kernel:
        """The 2-D kernel: `geometry` is (padding, output padding, end trim, strides, dilations, groups)."""
        padding, give_back, trim, strides, dilations, groups = geometry
        packed = torch.ops.mkldnn._reorder_convolution_transpose_weight(w, padding, give_back, strides, dilations,
                                                                         groups, in_shape)
        spec = layer.attrs.get("activation")
        unary, scalars, alg = fused_unary(spec) or ("none", [], None)   # else applied after it, in FP32
        post = spec if spec and unary == "none" else None
        deconv, finish = torch.ops.mkldnn._convolution_transpose_pointwise, finisher(post, layer.output_dtypes[0])
        memory = torch.channels_last if self.layout == HWC else torch.contiguous_format

        def trimmed(y):
            if not any(trim):
                return y
            y = y[(..., *(slice(0, size - t) for size, t in zip(y.shape[2:], trim)))]
            return y.contiguous(memory_format=memory)

        def run(xs):
            return finish(trimmed(deconv(to_compute(xs[0]), packed, bias, padding, give_back, strides, dilations,
                                         groups, unary, scalars, alg)))
        return run


class OneDnnDeconv1dTactic(OneDnnDeconvTactic):
    """A 1-D ConvTranspose on the 2-D kernel: [N, C, L] viewed as [N, C, 1, L], weights [C, O/g, 1, K]."""

    name = "onednn.deconv1d_prepacked"
    spatial_rank = 1
    layout = LINEAR

    def kernel(self, layer: LayerView, w, bias, geometry, in_shape, to_compute) -> Kernel:
        padding, give_back, trim, strides, dilations, groups = geometry
        planar = super().kernel(layer, w[:, :, None], bias, ([0, *padding], [0, *give_back], [0, *trim], [1, *strides],
                                [1, *dilations], groups), [*in_shape[:2], 1, *in_shape[2:]], to_compute)

        def run(xs):
            return [y.squeeze(2).contiguous() for y in planar([xs[0][:, :, None]])]
        return run


class Bf16Variant:
    """Mixin for a oneDNN tactic: the same kernel computing in BF16, offered only where the CPU has native BF16
    arithmetic (a loaded engine's kernel needing it falls back where it is missing: `required_isa`)."""

    compute_dtype = torch.bfloat16
    reduced_precisions = frozenset({"BF16"})
    required_isa = hardware.BF16_ISA
    bf16_inputs = frozenset({0, 3})   # read as they are where the plan stores them in bf16 (kiln.tactics.storage)
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and bf16_available()


class OneDnnBf16ConvTactic(Bf16Variant, OneDnnConvTactic):
    name = "onednn.conv2d_nhwc_prepacked_bf16"


class Fp16Variant:
    """Mixin for a oneDNN tactic: the same kernel computing in FP16 (AVX512-FP16), offered only where the CPU has
    it; FP32 tensors in and out (the plan stores no fp16 between layers), the conversions fused into the kernel."""

    compute_dtype = torch.float16
    reduced_precisions = frozenset({"FP16"})
    required_isa = hardware.FP16_ISA

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and fp16_available()


class OneDnnFp16ConvTactic(Fp16Variant, OneDnnConvTactic):
    name = "onednn.conv2d_nhwc_prepacked_fp16"


class OneDnnBf16Conv1dTactic(Bf16Variant, OneDnnConv1dTactic):
    name = "onednn.conv1d_prepacked_bf16"


class OneDnnFp16Conv1dTactic(Fp16Variant, OneDnnConv1dTactic):
    name = "onednn.conv1d_prepacked_fp16"


class OneDnnBf16DeconvTactic(Bf16Variant, OneDnnDeconvTactic):
    name = "onednn.deconv2d_nhwc_prepacked_bf16"


class OneDnnFp16DeconvTactic(Fp16Variant, OneDnnDeconvTactic):
    name = "onednn.deconv2d_nhwc_prepacked_fp16"


class OneDnnBf16Deconv1dTactic(Bf16Variant, OneDnnDeconv1dTactic):
    name = "onednn.deconv1d_prepacked_bf16"


class OneDnnFp16Deconv1dTactic(Fp16Variant, OneDnnDeconv1dTactic):
    name = "onednn.deconv1d_prepacked_fp16"
