"""QuantizeLinear / DequantizeLinear (opset 13+: per-tensor and per-axis, int8/uint8/int32; blocked
DequantizeLinear of opset 21, whose INT4 inputs the frontend reads as int8/uint8) in torch, and the
quantize/dequantize helpers kiln's INT8 layers share with them."""
from __future__ import annotations

import numpy as np
import torch

from kiln.ops.registry import OpKind, register, register_ms

RANGES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-32768, 32767),
          torch.uint16: (0, 65535), torch.int32: (-(2 ** 31), 2 ** 31 - 1)}
ONNX_INT_TYPES = {2: torch.uint8, 3: torch.int8, 4: torch.uint16, 5: torch.int16, 6: torch.int32}


def per_axis(t: torch.Tensor, rank: int, axis: int) -> torch.Tensor:
    """A scale/zero point shaped to broadcast along `axis` of a rank-`rank` tensor (scalars stay scalars)."""
    if t.dim() == 0 or t.numel() == 1:
        return t.reshape(())
    shape = [1] * rank
    shape[axis % rank] = t.numel()
    return t.reshape(shape)


def quantize(x: torch.Tensor, scale, zero_point, dtype: torch.dtype, axis: int = 1) -> torch.Tensor:
    """round-half-to-even(x / scale) + zero_point, saturated to `dtype`."""
    scale = per_axis(torch.as_tensor(scale, dtype=torch.float32), x.dim(), axis)
    zp = per_axis(torch.as_tensor(zero_point).to(torch.float32), x.dim(), axis)
    lo, hi = RANGES[dtype]
    if x.device.type == "meta":
        return torch.empty(x.shape, dtype=dtype, device="meta")
    return torch.clamp(torch.round(x.to(torch.float32) / scale) + zp, lo, hi).to(dtype)


def dequantize(q: torch.Tensor, scale, zero_point, axis: int = 1) -> torch.Tensor:
    scale = torch.as_tensor(scale)
    out_dtype = scale.dtype if scale.is_floating_point() else torch.float32
    scale = per_axis(scale.to(torch.float32), q.dim(), axis)
    if q.device.type == "meta":
        return torch.empty(q.shape, dtype=out_dtype, device="meta")
    zp = per_axis(torch.as_tensor(zero_point).to(torch.float32), q.dim(), axis) if zero_point is not None else 0.0
    return ((q.to(torch.float32) - zp) * scale).to(out_dtype)


def _output_dtype(attrs, zero_point) -> torch.dtype:
    if zero_point is not None:
        return zero_point.dtype
    if attrs.get("output_dtype"):
        return ONNX_INT_TYPES[attrs["output_dtype"]]
    return torch.uint8


def _q_args(attrs, xs):
    """(tensor, scale, zero point or None) of QuantizeLinear/DequantizeLinear; blocked quantization is refused."""
    if attrs.get("block_size"):
        raise NotImplementedError("blocked quantization (block_size) is not supported")
    return xs[0], xs[1], xs[2] if len(xs) > 2 else None


def unblocked(t: torch.Tensor | None, length: int, axis: int, block_size: int) -> torch.Tensor | None:
    """A blocked scale or zero point (opset 21: one per `block_size` elements along `axis`) repeated to one per
    element, `length` along that axis: what per-element dequantization reads."""
    if t is None:
        return None
    return torch.repeat_interleave(t, block_size, dim=axis).narrow(axis, 0, length)


def _dequantize_blocked(attrs, xs) -> torch.Tensor:
    q, scale = xs[0], xs[1]
    zp = xs[2] if len(xs) > 2 else None
    axis, block = attrs.get("axis", 1) % q.dim(), int(attrs["block_size"])
    expected = [*q.shape[:axis], -(-q.shape[axis] // block), *q.shape[axis + 1:]]
    if list(scale.shape) != expected:
        raise ValueError(f"blocked DequantizeLinear: scale shape {list(scale.shape)} must be {expected} "
                         f"(input {list(q.shape)}, axis {axis}, block_size {block})")
    dtype = scale.dtype if scale.is_floating_point() else torch.float32
    if q.device.type == "meta" or scale.device.type == "meta":
        return torch.empty(q.shape, dtype=dtype, device="meta")
    scale = unblocked(scale.to(torch.float32), q.shape[axis], axis, block)
    zp = unblocked(zp, q.shape[axis], axis, block)
    shifted = q.to(torch.float32) - (zp.to(torch.float32) if zp is not None else 0.0)
    return (shifted * scale).to(dtype)


@register("QuantizeLinear", OpKind.ELEMENTWISE)
def quantize_linear(attrs, xs):
    x, scale, zp = _q_args(attrs, xs)
    dtype = _output_dtype(attrs, zp)
    if dtype not in RANGES:
        raise NotImplementedError(f"QuantizeLinear to {dtype} is not supported (int8/uint8/int16/uint16/int32)")
    if x.device.type == "meta" or scale.device.type == "meta":
        return [torch.empty(x.shape, dtype=dtype, device="meta")]
    return [quantize(x, scale, zp if zp is not None else 0, dtype, attrs.get("axis", 1))]


@register("DequantizeLinear", OpKind.ELEMENTWISE)
def dequantize_linear(attrs, xs):
    if attrs.get("block_size"):   # weight-only quantization (INT4 / INT8 blocks): evaluated as a constant
        return [_dequantize_blocked(attrs, xs)]
    q, scale, zp = _q_args(attrs, xs)
    if q.device.type == "meta" or scale.device.type == "meta":
        dtype = scale.dtype if scale.is_floating_point() else torch.float32
        return [torch.empty(q.shape, dtype=dtype, device="meta")]
    return [dequantize(q, scale, zp, attrs.get("axis", 1))]


def _zp(xs, i):
    return xs[i] if len(xs) > i and xs[i] is not None else 0


def _meta(shape, dtype):
    return [torch.empty(shape, dtype=dtype, device="meta")]


@register("QLinearConv", OpKind.COMPLEX)
def qlinear_conv(attrs, xs):
    """QOperator-format INT8 conv: x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp[, bias int32]."""
    from kiln.ops.registry import OPS

    x = dequantize(xs[0], xs[1], _zp(xs, 2))
    w = dequantize(xs[3], xs[4], _zp(xs, 5), axis=0)
    bias = xs[8] if len(xs) > 8 and xs[8] is not None else None
    if bias is not None:
        bias = dequantize(bias, torch.as_tensor(xs[1]).reshape(()) * torch.as_tensor(xs[4]).reshape(-1), 0, axis=0)
    y = OPS["Conv"].impl(attrs, [x, w, bias])[0]
    dtype = xs[7].dtype if len(xs) > 7 and xs[7] is not None else xs[0].dtype
    return [quantize(y, xs[6], _zp(xs, 7), dtype)]


@register("QLinearMatMul", OpKind.COMPLEX)
def qlinear_matmul(attrs, xs):
    """a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp (per-tensor, or per-column for b)."""
    a = dequantize(xs[0], xs[1], xs[2])
    b = dequantize(xs[3], xs[4], xs[5], axis=-1)
    return [quantize(torch.matmul(a, b), xs[6], xs[7], xs[7].dtype)]


@register("MatMulInteger", OpKind.COMPLEX)
def matmul_integer(attrs, xs):
    """int32 = (a - a_zp) @ (b - b_zp), exact (int64 accumulation, then int32)."""
    a = xs[0].to(torch.int64) - torch.as_tensor(_zp(xs, 2)).to(torch.int64)
    bz = torch.as_tensor(_zp(xs, 3)).to(torch.int64)
    b = xs[1].to(torch.int64) - (bz.reshape(-1) if bz.dim() else bz)
    if a.device.type == "meta" or b.device.type == "meta":
        return _meta(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), torch.int32)
    return [torch.matmul(a.to(torch.float64), b.to(torch.float64)).round().to(torch.int32)]


@register("ConvInteger", OpKind.COMPLEX)
def conv_integer(attrs, xs):
    from kiln.ops.registry import OPS

    x = xs[0].to(torch.float64) - torch.as_tensor(_zp(xs, 2)).to(torch.float64)
    wz = torch.as_tensor(_zp(xs, 3)).to(torch.float64)
    w = xs[1].to(torch.float64) - (wz.reshape(-1, *([1] * (xs[1].dim() - 1))) if wz.dim() else wz)
    return [OPS["Conv"].impl(attrs, [x, w, None])[0].round().to(torch.int32)]


@register("DynamicQuantizeLinear", OpKind.OPAQUE)
def dynamic_quantize_linear(attrs, xs):
    """uint8 quantization with the scale and zero point computed from the tensor's own range (ONNX formula)."""
    x = xs[0]
    if x.device.type == "meta":
        return _meta(x.shape, torch.uint8) + _meta((), torch.float32) + _meta((), torch.uint8)
    scale, zero = dynamic_qparams(x)
    y = quantize(x, scale, zero, torch.uint8)
    return [y, torch.tensor(scale, dtype=torch.float32), torch.tensor(zero, dtype=torch.uint8)]


def dynamic_qparams(x: torch.Tensor) -> tuple[np.float32, int]:
    """DynamicQuantizeLinear's u8 scale and zero point for `x`'s range widened to hold 0, in FP32 arithmetic as
    onnxruntime computes them (kiln_dqgemm's too); NaN (a timing run's random data can make one) is left out."""
    known = x[~torch.isnan(x)] if x.dtype.is_floating_point else x
    lo = np.float32(min(float(known.min()), 0.0)) if known.numel() else np.float32(0)
    hi = np.float32(max(float(known.max()), 0.0)) if known.numel() else np.float32(0)
    scale = np.float32(1) if hi == lo else (hi - lo) / np.float32(255)
    zero = int(np.clip(np.rint(-lo / scale), 0, 255))   # round half to even, as the spec's rint
    return scale, zero


# ---- com.microsoft QOperator ops (onnxruntime's quantize_static, QOperator format) ----
def _binary(fn):
    def impl(attrs, xs):
        a = dequantize(xs[0], xs[1], _zp(xs, 2))
        b = dequantize(xs[3], xs[4], _zp(xs, 5))
        return [quantize(fn(a, b), xs[6], _zp(xs, 7), xs[0].dtype)]
    return impl


register_ms("QLinearAdd", OpKind.ELEMENTWISE)(_binary(torch.add))
register_ms("QLinearMul", OpKind.ELEMENTWISE)(_binary(torch.mul))


@register_ms("QLinearGlobalAveragePool", OpKind.REDUCTION)
def qlinear_global_average_pool(attrs, xs):
    x = dequantize(xs[0], xs[1], _zp(xs, 2))
    if attrs.get("channels_last", 0):
        y = x.mean(dim=tuple(range(1, x.dim() - 1)), keepdim=True)
    else:
        y = x.mean(dim=tuple(range(2, x.dim())), keepdim=True)
    return [quantize(y, xs[3], _zp(xs, 4), xs[0].dtype)]


@register_ms("QLinearConcat", OpKind.INJECTIVE)
def qlinear_concat(attrs, xs):
    """y_scale, y_zp, then (x, x_scale, x_zp) per input."""
    parts = [dequantize(xs[i], xs[i + 1], xs[i + 2]) for i in range(2, len(xs), 3)]
    return [quantize(torch.cat(parts, attrs["axis"]), xs[0], xs[1], xs[2].dtype)]


@register_ms("QLinearSigmoid", OpKind.ELEMENTWISE)
def qlinear_sigmoid(attrs, xs):
    return [quantize(torch.sigmoid(dequantize(xs[0], xs[1], _zp(xs, 2))), xs[3], _zp(xs, 4), xs[0].dtype)]


@register_ms("QLinearLeakyRelu", OpKind.ELEMENTWISE)
def qlinear_leaky_relu(attrs, xs):
    y = torch.nn.functional.leaky_relu(dequantize(xs[0], xs[1], _zp(xs, 2)), attrs.get("alpha", 0.01))
    return [quantize(y, xs[3], _zp(xs, 4), xs[0].dtype)]


@register_ms("QGemm", OpKind.COMPLEX)
def qgemm(attrs, xs):
    """A, a_scale, a_zp, B, b_scale, b_zp, C (int32, scale a_scale*b_scale), y_scale, y_zp; float output without
    y_scale."""
    a = dequantize(xs[0], xs[1], _zp(xs, 2))
    b = dequantize(xs[3], xs[4], _zp(xs, 5), axis=0 if attrs.get("transB", 0) else 1)
    a = a.transpose(-1, -2) if attrs.get("transA", 0) else a
    b = b.transpose(-1, -2) if attrs.get("transB", 0) else b
    y = attrs.get("alpha", 1.0) * torch.matmul(a, b)
    if len(xs) > 6 and xs[6] is not None:
        scale = torch.as_tensor(xs[1]).reshape(()) * torch.as_tensor(xs[4]).reshape(-1)
        y = y + dequantize(xs[6], scale, 0, axis=-1 if xs[6].dim() else 0)
    if len(xs) > 7 and xs[7] is not None:
        return [quantize(y, xs[7], _zp(xs, 8), xs[8].dtype if len(xs) > 8 and xs[8] is not None else torch.uint8)]
    return [y]


@register_ms("QLinearSoftmax", OpKind.REDUCTION)
def qlinear_softmax(attrs, xs):
    """X, x_scale, x_zp, y_scale, y_zp; `opset` < 13 is the old form: softmax over the axes from `axis` on."""
    x = dequantize(xs[0], xs[1], _zp(xs, 2))
    axis = attrs.get("axis", -1) % max(x.dim(), 1)
    if attrs.get("opset", 13) < 13 and axis != x.dim() - 1:
        y = torch.softmax(x.reshape(*x.shape[:axis], -1), dim=-1).reshape(x.shape)
    else:
        y = torch.softmax(x, dim=axis)
    return [quantize(y, xs[3], _zp(xs, 4), xs[4].dtype if len(xs) > 4 and xs[4] is not None else xs[0].dtype)]


@register_ms("QLinearAveragePool", OpKind.REDUCTION)
def qlinear_average_pool(attrs, xs):
    """X, x_scale, x_zp, y_scale, y_zp, AveragePool's attributes; channels_last=1: NHWC in and out."""
    from kiln.ops.registry import OPS

    x = dequantize(xs[0], xs[1], _zp(xs, 2))
    nhwc = bool(attrs.get("channels_last", 0))
    if nhwc:
        x = x.movedim(-1, 1)
    y = OPS["AveragePool"].impl({k: v for k, v in attrs.items() if k != "channels_last"}, [x])[0]
    if nhwc:
        y = y.movedim(1, -1)
    return [quantize(y, xs[3], _zp(xs, 4), xs[0].dtype)]
