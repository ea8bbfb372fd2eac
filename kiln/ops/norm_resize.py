"""Normalization, PRelu, ConvTranspose and Resize ONNX ops in torch (ops common in real CNN exports)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.nn import apply_activation
from kiln.ops.registry import OpKind, register


@register("PRelu", OpKind.ELEMENTWISE)
def prelu(attrs, xs):
    x, slope = xs
    return [torch.where(x >= 0, x, x * slope)]


@register("LayerNormalization", OpKind.REDUCTION)
def layer_norm(attrs, xs):
    """ONNX LayerNormalization: Y, and the optional Mean and InvStdDev (computed in float32 by default)."""
    x, scale = xs[0], xs[1]
    bias = xs[2] if len(xs) > 2 else None
    axis = attrs.get("axis", -1) % x.dim()
    dims = tuple(range(axis, x.dim()))
    h = x.to(_STASH_TYPES.get(attrs.get("stash_type", 1), torch.float32))
    mean = h.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(((h - mean) ** 2).mean(dim=dims, keepdim=True) + attrs.get("epsilon", 1e-5))
    y = ((h - mean) * inv_std).to(x.dtype) * scale
    return [y + bias if bias is not None else y, mean, inv_std]


_STASH_TYPES = {1: torch.float32, 10: torch.float16, 11: torch.float64}   # ONNX element type -> torch


@register("RMSNormalization", OpKind.REDUCTION)
def rms_norm(attrs, xs):
    """ONNX RMSNormalization (opset 23): x / sqrt(mean(x^2 over the axes from `axis`) + epsilon) * scale."""
    x, scale = xs[0], xs[1]
    axis = attrs.get("axis", -1) % x.dim()
    h = x.to(_STASH_TYPES.get(attrs.get("stash_type", 1), torch.float32))
    inv_rms = torch.rsqrt((h * h).mean(dim=tuple(range(axis, x.dim())), keepdim=True) + attrs.get("epsilon", 1e-5))
    return [(h * inv_rms).to(x.dtype) * scale]


@register("InstanceNormalization", OpKind.REDUCTION)
def instance_norm(attrs, xs):
    x, scale, bias = xs
    shape = [1, -1] + [1] * (x.dim() - 2)
    dims = tuple(range(2, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5))
    return [apply_activation(attrs.get("activation"), y * scale.reshape(shape) + bias.reshape(shape))]


@register("GroupNormalization", OpKind.REDUCTION)
def group_norm(attrs, xs):
    x, scale, bias = xs
    groups = attrs["num_groups"]
    n, c = x.shape[0], x.shape[1]
    g = x.reshape(n, groups, -1)
    mean = g.mean(dim=2, keepdim=True)
    var = ((g - mean) ** 2).mean(dim=2, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5))).reshape(x.shape)
    shape = [1, -1] + [1] * (x.dim() - 2)
    scale, bias = per_channel(scale, c, groups), per_channel(bias, c, groups)
    return [apply_activation(attrs.get("activation"), y * scale.reshape(shape) + bias.reshape(shape))]


def per_channel(param: torch.Tensor, channels: int, groups: int) -> torch.Tensor:
    """A GroupNormalization scale or bias with one value per channel: opset 18's one per group repeated."""
    param = param.reshape(-1)
    return param.repeat_interleave(channels // groups) if param.numel() == groups and groups != channels else param


def conv_transpose_geometry(attrs: dict, in_spatial: list[int], kernel_spatial: list[int]):
    """ConvTranspose's (strides, dilations, output_padding, pads [begins..., ends...]) with auto_pad and
    output_shape resolved into pads, as ONNX defines them."""
    n = len(kernel_spatial)
    strides = list(attrs.get("strides") or [1] * n)
    dilations = list(attrs.get("dilations") or [1] * n)
    kernel = list(attrs.get("kernel_shape") or kernel_spatial)
    out_pad = list(attrs.get("output_padding") or [0] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    if attrs.get("output_shape") or attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        target = list(attrs.get("output_shape") or [d * s for d, s in zip(in_spatial, strides)])[-n:]
        for i in range(n):
            total = strides[i] * (in_spatial[i] - 1) + out_pad[i] + ((kernel[i] - 1) * dilations[i] + 1) - target[i]
            small, big = total // 2, total - total // 2
            upper = attrs.get("auto_pad") == "SAME_UPPER"   # ONNX: NOTSET and SAME_LOWER put the larger half first
            pads[i], pads[i + n] = (small, big) if upper else (big, small)
    return strides, dilations, out_pad, pads


@register("ConvTranspose", OpKind.COMPLEX)
def conv_transpose(attrs, xs):
    """ONNX ConvTranspose; kiln's fused form adds `activation`."""
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    n = w.dim() - 2
    strides, dilations, out_pad, pads = conv_transpose_geometry(attrs, list(x.shape[2:]), list(w.shape[2:]))
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
    return [apply_activation(attrs.get("activation"), y)]


def _source_coords(out_size: int, in_size: int, scale: float, mode: str, roi) -> torch.Tensor:
    """Each output index's coordinate in the input. align_corners and tf_crop_and_resize divide by the output
    length, as the spec text, onnxruntime and PyTorch do (onnx's reference uses scale * in_size unrounded)."""
    x = torch.arange(out_size, dtype=torch.float64)
    if mode == "asymmetric":
        return x / scale
    if mode == "align_corners":
        return x * (in_size - 1) / (out_size - 1) if out_size > 1 else torch.zeros_like(x)
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_size > 1 else torch.zeros_like(x)
    if mode == "half_pixel_symmetric":
        center = in_size / 2 * (1 - out_size / (scale * in_size))
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
    return idx.clamp(0, in_size - 1).to(torch.int64)[:, None]


def _linear_weights(ratio: torch.Tensor, scale: float, attrs) -> torch.Tensor:
    if not attrs.get("antialias", 0):
        return torch.stack([1 - ratio, ratio], dim=1)
    s = min(scale, 1.0)   # antialiasing widens the kernel only when downsampling
    start = math.floor(-1 / s) + 1
    args = (torch.arange(start, 2 - start, dtype=torch.float64)[None, :] - ratio[:, None]) * s
    w = (1 - args.abs()).clamp(0, 1)
    return w / w.sum(dim=1, keepdim=True)


def _cubic_kernel(x: torch.Tensor, a: float) -> torch.Tensor:
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _cubic_weights(ratio: torch.Tensor, scale: float, attrs) -> torch.Tensor:
    a = attrs.get("cubic_coeff_a", -0.75)
    if not attrs.get("antialias", 0):
        return _cubic_kernel(torch.stack([ratio + 1, ratio, 1 - ratio, 2 - ratio], dim=1), a)
    s = min(scale, 1.0)
    start = math.floor(-2 / s) + 1
    w = _cubic_kernel((torch.arange(start, 2 - start, dtype=torch.float64)[None, :] - ratio[:, None]) * s, a)
    return w / w.sum(dim=1, keepdim=True)


_WEIGHTS = {"linear": _linear_weights, "cubic": _cubic_weights}


def _taps(coords: torch.Tensor, in_size: int, scale: float, attrs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Input indices [out, n] (clamped: edge padding) and weights [out, n] (None: nearest, one tap)."""
    mode = attrs.get("mode", "nearest")
    if mode == "nearest":
        return _nearest_index(coords, attrs.get("nearest_mode", "round_prefer_floor"), in_size), None
    if mode not in _WEIGHTS:
        raise NotImplementedError(f"Resize mode '{mode}' (kiln supports nearest, linear and cubic)")
    base = torch.floor(coords)
    weights = _WEIGHTS[mode](torch.where(coords == base, 1.0, coords - base), scale, attrs)
    n = weights.shape[1]
    # the n input positions nearest the coordinate, ties to the lower index (a ratio of 1 at integers)
    frac = coords - base
    if n % 2 == 0:
        first = base + torch.where(frac == 0, -(n // 2), 1 - n // 2)
    else:
        first = base + torch.where(frac <= 0.5, -((n - 1) // 2), 1 - (n - 1) // 2)
    idx = first.to(torch.int64)[:, None] + torch.arange(n)[None, :]
    if attrs.get("exclude_outside", 0):
        weights = torch.where((idx < 0) | (idx >= in_size), 0.0, weights)
        total = weights.sum(dim=1, keepdim=True)
        weights = weights / torch.where(total == 0, 1.0, total)
    return idx.clamp(0, in_size - 1), weights


def _resize_axis(y: torch.Tensor, axis: int, out_size: int, scale: float, roi, attrs) -> torch.Tensor:
    in_size = y.shape[axis]
    coords = _source_coords(out_size, in_size, scale, attrs.get("coordinate_transformation_mode", "half_pixel"), roi)
    idx, weights = _taps(coords, in_size, scale, attrs)
    idx = idx.to(y.device)
    if weights is None:
        y = torch.index_select(y, axis, idx[:, 0])
    else:   # a weighted sum of the n taps, one gather each
        w = weights.to(y.dtype).to(y.device).reshape(out_size, idx.shape[1], *[1] * (y.dim() - axis - 1))
        taps = [torch.index_select(y, axis, idx[:, j]) for j in range(idx.shape[1])]
        y = taps[0] * w[:, 0]
        for j in range(1, len(taps)):
            y.addcmul_(taps[j], w[:, j])
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        outside = ((coords < 0) | (coords > in_size - 1)).reshape(out_size, *[1] * (y.dim() - axis - 1))
        fill = torch.tensor(attrs.get("extrapolation_value", 0.0), dtype=y.dtype, device=y.device)
        y = torch.where(outside.to(y.device), fill, y)
    return y


def _resize_targets(shape: list[int], scales, sizes, axes: list[int], attrs) -> tuple[list[int], list[float]]:
    """Output size and scale per axis, from `sizes` (with keep_aspect_ratio_policy) or `scales`."""
    rank = len(shape)
    if not sizes:
        scale = [1.0] * rank
        for a, s in zip(axes, scales):
            scale[a] = float(s)
        return [math.floor(shape[a] * scale[a]) for a in range(rank)], scale
    out = list(shape)
    for a, s in zip(axes, sizes):
        out[a] = int(s)
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")
    if policy == "stretch":
        return out, [out[a] / shape[a] for a in range(rank)]
    pick = min if policy == "not_larger" else max
    common = pick(out[a] / shape[a] for a in axes)
    return ([int(common * shape[a] + 0.5) if a in axes else shape[a] for a in range(rank)],
            [common if a in axes else 1.0 for a in range(rank)])


def _resampled_axes(attrs, shape: list[int], roi, scales, sizes) -> list[tuple[int, int, float, tuple]]:
    """(axis, output size, scale, roi) for every axis a Resize actually resamples, in axis order."""
    rank = len(shape)
    axes = [a % rank for a in attrs.get("axes", list(range(rank)))]
    out, scale = _resize_targets(list(shape), scales, sizes, axes, attrs)
    rois = {a: (0.0, 1.0) for a in range(rank)}
    for i, a in enumerate(axes if roi is not None and len(roi) else ()):
        rois[a] = (float(roi[i]), float(roi[i + len(axes)]))
    return [(a, out[a], scale[a], rois[a]) for a in axes
            if out[a] != shape[a] or not math.isclose(scale[a], 1.0) or rois[a] != (0.0, 1.0)]


@register("Resize", OpKind.INJECTIVE, host_inputs=(1, 2, 3))
def resize(attrs, xs):
    """ONNX Resize (nearest, linear, cubic; antialias; every coordinate transformation mode), one axis at a time."""
    x = xs[0]
    roi, scales, sizes = (xs[i] if len(xs) > i else None for i in (1, 2, 3))
    exact = attrs.get("mode", "nearest") == "nearest" or x.dtype in (torch.float32, torch.float64)
    y = x if exact else x.to(torch.float32)   # interpolate narrow floats and integers in float32
    for a, out_size, scale, axis_roi in _resampled_axes(attrs, list(x.shape), roi, scales, sizes):
        y = _resize_axis(y, a, out_size, scale, axis_roi, attrs)
    if y.dtype == x.dtype or x.dtype.is_floating_point:
        return [y.to(x.dtype)]
    info = torch.iinfo(x.dtype)   # integers round and saturate, as the ONNX reference does
    return [torch.round(y).clamp(info.min, info.max).to(x.dtype)]


def resize_taps(attrs, shape: list[int], roi, scales, sizes) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """For a Resize of an input of `shape`, by the rule `resize` applies: per axis, the input indices [out, taps]
    each output index reads and their weights [out, taps] (float64; None for nearest and on an axis left alone: one
    tap of weight 1); None for tf_crop_and_resize, whose extrapolated pixels read no input."""
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        return None
    taps = [(torch.arange(n)[:, None], None) for n in shape]
    for a, out_size, scale, axis_roi in _resampled_axes(attrs, shape, roi, scales, sizes):
        coords = _source_coords(out_size, shape[a], scale, attrs.get("coordinate_transformation_mode", "half_pixel"),
                                axis_roi)
        taps[a] = _taps(coords, shape[a], scale, attrs)
    return taps
