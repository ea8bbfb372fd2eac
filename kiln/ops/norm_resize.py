"""Normalization, PRelu, ConvTranspose and Resize ONNX ops in torch (ops common in real CNN exports)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.registry import OpKind, register


@register("PRelu", OpKind.ELEMENTWISE, trt_layer="Activation")
def prelu(attrs, xs):
    x, slope = xs
    return [torch.where(x >= 0, x, x * slope)]


@register("LayerNormalization", OpKind.REDUCTION, trt_layer="Normalization")
def layer_norm(attrs, xs):
    x, scale = xs[0], xs[1]
    bias = xs[2] if len(xs) > 2 else None
    axis = attrs.get("axis", -1) % x.dim()
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5)) * scale
    return [y + bias if bias is not None else y]


@register("InstanceNormalization", OpKind.REDUCTION, trt_layer="Normalization")
def instance_norm(attrs, xs):
    x, scale, bias = xs
    shape = [1, -1] + [1] * (x.dim() - 2)
    dims = tuple(range(2, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5))
    return [y * scale.reshape(shape) + bias.reshape(shape)]


@register("GroupNormalization", OpKind.REDUCTION, trt_layer="Normalization")
def group_norm(attrs, xs):
    x, scale, bias = xs
    groups = attrs["num_groups"]
    n, c = x.shape[0], x.shape[1]
    g = x.reshape(n, groups, -1)
    mean = g.mean(dim=2, keepdim=True)
    var = ((g - mean) ** 2).mean(dim=2, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5))).reshape(x.shape)
    shape = [1, -1] + [1] * (x.dim() - 2)
    if scale.numel() == groups and groups != c:   # opset 18 form: one scale per group
        scale = scale.repeat_interleave(c // groups)
        bias = bias.repeat_interleave(c // groups)
    return [y * scale.reshape(shape) + bias.reshape(shape)]


@register("ConvTranspose", OpKind.COMPLEX, trt_layer="Deconvolution")
def conv_transpose(attrs, xs):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    n = w.dim() - 2
    strides = attrs.get("strides") or [1] * n
    dilations = attrs.get("dilations") or [1] * n
    kernel = attrs.get("kernel_shape") or list(w.shape[2:])
    out_pad = list(attrs.get("output_padding") or [0] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    in_sp = list(x.shape[2:])
    if attrs.get("output_shape") or attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        target = list(attrs.get("output_shape") or [d * s for d, s in zip(in_sp, strides)])[-n:]
        for i in range(n):
            total = strides[i] * (in_sp[i] - 1) + out_pad[i] + ((kernel[i] - 1) * dilations[i] + 1) - target[i]
            small, big = total // 2, total - total // 2
            upper = attrs.get("auto_pad") == "SAME_UPPER"   # ONNX: NOTSET and SAME_LOWER put the larger half first
            pads[i], pads[i + n] = (small, big) if upper else (big, small)
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[n]
    # full transposed convolution, then crop [begin, full - end + output_padding) per axis (zero-extend if needed)
    y = fn(x, w, None, strides, [0] * n, [0] * n, attrs.get("group", 1), dilations)
    index = [slice(None), slice(None)]
    for i in range(n):
        stop = y.shape[2 + i] - pads[i + n] + out_pad[i]
        if stop > y.shape[2 + i]:
            y = F.pad(y, [0, 0] * (n - 1 - i) + [0, stop - y.shape[2 + i]])
        index.append(slice(pads[i], stop))
    y = y[tuple(index)]
    if b is not None:
        y = y + b.reshape([1, -1] + [1] * n)
    return [y]


def _source_coords(out_size: int, in_size: int, scale: float, mode: str, roi=None) -> torch.Tensor:
    x = torch.arange(out_size, dtype=torch.float64)
    if mode == "asymmetric":
        return x / scale
    if mode == "align_corners":
        return x * (in_size - 1) / (out_size - 1) if out_size > 1 else torch.zeros_like(x)
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_size > 1 else torch.zeros_like(x)
    if mode == "half_pixel_symmetric":
        adj = out_size / (scale * in_size)
        center = in_size / 2 * (1 - adj)
        return center + (x + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_size > 1:
            return start * (in_size - 1) + x * (end - start) * (in_size - 1) / (out_size - 1)
        return torch.full_like(x, 0.5 * (start + end) * (in_size - 1))
    return (x + 0.5) / scale - 0.5   # half_pixel (default)


def _nearest_index(coords: torch.Tensor, mode: str, in_size: int) -> torch.Tensor:
    if mode == "floor":
        idx = torch.floor(coords)
    elif mode == "ceil":
        idx = torch.ceil(coords)
    elif mode == "round_prefer_ceil":
        idx = torch.floor(coords + 0.5)
    else:   # round_prefer_floor (default)
        idx = torch.ceil(coords - 0.5)
    return idx.clamp(0, in_size - 1).to(torch.int64)


@register("Resize", OpKind.INJECTIVE, host_inputs=(1, 2, 3), trt_layer="Resize")
def resize(attrs, xs):
    """ONNX Resize (nearest, linear; separable per axis; every coordinate transformation mode)."""
    x = xs[0]
    roi, scales, sizes = (xs[i] if len(xs) > i else None for i in (1, 2, 3))
    rank = x.dim()
    axes = [a % rank for a in attrs.get("axes", list(range(rank)))]
    if sizes:
        out = list(x.shape)
        for a, s in zip(axes, sizes):
            out[a] = int(s)
        scale_list = [out[a] / x.shape[a] for a in range(rank)]
    else:
        scale_list = [1.0] * rank
        for a, s in zip(axes, scales):
            scale_list[a] = float(s)
        out = [int(math.floor(x.shape[a] * scale_list[a])) for a in range(rank)]
    mode = attrs.get("mode", "nearest")
    coord_mode = attrs.get("coordinate_transformation_mode", "half_pixel")
    y = x
    for a in range(rank):
        if out[a] == x.shape[a] and scale_list[a] == 1.0:
            continue
        r = (roi[a], roi[a + rank]) if roi else (0.0, 1.0)
        coords = _source_coords(out[a], x.shape[a], scale_list[a], coord_mode, r)
        if mode == "nearest":
            idx = _nearest_index(coords, attrs.get("nearest_mode", "round_prefer_floor"), x.shape[a])
            y = torch.index_select(y, a, idx.to(y.device))
        elif mode == "linear":
            coords = coords.clamp(0, x.shape[a] - 1)
            lo = torch.floor(coords).to(torch.int64)
            hi = (lo + 1).clamp(max=x.shape[a] - 1)
            frac = (coords - lo).to(y.dtype)
            shape = [1] * rank
            shape[a] = -1
            y0, y1 = torch.index_select(y, a, lo.to(y.device)), torch.index_select(y, a, hi.to(y.device))
            y = y0 + (y1 - y0) * frac.reshape(shape).to(y.device)
        else:
            raise NotImplementedError(f"Resize mode '{mode}' (kiln supports nearest and linear)")
    return [y]
