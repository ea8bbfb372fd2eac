"""QuantizeLinear / DequantizeLinear (opset 13+: per-tensor and per-axis, int8/uint8/int32) in torch, and the
quantize/dequantize helpers kiln's INT8 layers share with them."""
from __future__ import annotations

import torch

from kiln.ops.registry import OpKind, register

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


@register("QuantizeLinear", OpKind.ELEMENTWISE, trt_layer="Reformat")
def quantize_linear(attrs, xs):
    x, scale = xs[0], xs[1]
    zp = xs[2] if len(xs) > 2 else None
    if attrs.get("block_size"):
        raise NotImplementedError("blocked quantization (block_size) is not supported")
    dtype = _output_dtype(attrs, zp)
    if dtype not in RANGES:
        raise NotImplementedError(f"QuantizeLinear to {dtype} is not supported (int8/uint8/int16/uint16/int32)")
    if x.device.type == "meta" or scale.device.type == "meta":
        return [torch.empty(x.shape, dtype=dtype, device="meta")]
    return [quantize(x, scale, zp if zp is not None else 0, dtype, attrs.get("axis", 1))]


@register("DequantizeLinear", OpKind.ELEMENTWISE, trt_layer="Reformat")
def dequantize_linear(attrs, xs):
    q, scale = xs[0], xs[1]
    zp = xs[2] if len(xs) > 2 else None
    if attrs.get("block_size"):
        raise NotImplementedError("blocked quantization (block_size) is not supported")
    if q.device.type == "meta" or scale.device.type == "meta":
        dtype = scale.dtype if scale.is_floating_point() else torch.float32
        return [torch.empty(q.shape, dtype=dtype, device="meta")]
    return [dequantize(q, scale, zp, attrs.get("axis", 1))]
