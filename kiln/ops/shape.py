"""Data-movement and shape ONNX ops (reshape, transpose, slice, gather, concat, ...) in torch."""
from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops.registry import OpKind, register

INJ = OpKind.INJECTIVE


def reshape_target(in_shape, shape, allowzero: int = 0) -> list[int]:
    """ONNX Reshape semantics: 0 copies the input dim (unless allowzero), -1 is inferred."""
    out = [in_shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(shape)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        total = math.prod(in_shape)
        out[out.index(-1)] = total // known if known else 0
    return out


@register("Reshape", INJ, host_inputs=(1,))
def reshape(attrs, xs):
    x = xs[0]
    return [x.reshape(reshape_target(list(x.shape), xs[1], attrs.get("allowzero", 0)))]


@register("Flatten", INJ)
def flatten(attrs, xs):
    x = xs[0]
    axis = attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis   # ONNX: axis in [-r, r], negative counts from the back
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


@register("Transpose", INJ)
def transpose(attrs, xs):
    x = xs[0]
    perm = attrs.get("perm") or list(reversed(range(x.dim())))
    return [x.permute(*perm)]


@register("Squeeze", INJ, host_inputs=(1,))
def squeeze(attrs, xs):
    x = xs[0]
    axes = xs[1] if len(xs) > 1 and xs[1] is not None else attrs.get("axes")
    if axes is None:
        return [x.reshape([d for d in x.shape if d != 1])]
    axes = {a % x.dim() for a in axes}
    return [x.reshape([d for i, d in enumerate(x.shape) if i not in axes])]


@register("Unsqueeze", INJ, host_inputs=(1,))
def unsqueeze(attrs, xs):
    x = xs[0]
    axes = xs[1] if len(xs) > 1 and xs[1] is not None else attrs["axes"]
    rank = x.dim() + len(axes)
    axes = sorted(a % rank for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return [x.reshape(shape)]


@register("Concat", INJ)
def concat(attrs, xs):
    parts = [x for x in xs if x is not None]
    return [torch.cat(parts, dim=attrs["axis"])]


@register("Shape", OpKind.SHAPE)
def shape(attrs, xs):
    dims = list(xs[0].shape)
    start, end = attrs.get("start", 0), attrs.get("end", len(dims))
    return [torch.tensor(dims[slice(start, end)], dtype=torch.int64)]


@register("Size", OpKind.SHAPE)
def size(attrs, xs):
    return [torch.tensor(math.prod(xs[0].shape), dtype=torch.int64)]


@register("Gather", INJ)
def gather(attrs, xs):
    data, idx = xs
    axis = attrs.get("axis", 0) % data.dim()
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    out = torch.index_select(data, axis, idx.reshape(-1))
    return [out.reshape(tuple(data.shape[:axis]) + tuple(idx.shape) + tuple(data.shape[axis + 1:]))]


@register("Slice", INJ, host_inputs=(1, 2, 3, 4))
def slice_(attrs, xs):
    x = xs[0]
    starts, ends = xs[1], xs[2]
    axes = xs[3] if len(xs) > 3 and xs[3] is not None else list(range(len(starts)))
    steps = xs[4] if len(xs) > 4 and xs[4] is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= x.dim()
        n = x.shape[a]
        if st > 0:
            s = max(0, min(n, s + n if s < 0 else s))
            e = max(0, min(n, e + n if e < 0 else e))
            index[a] = slice(s, max(s, e), st)
        else:  # negative step: clamp like ONNX, then take a forward slice and flip it
            s = max(-1, min(n - 1, s + n if s < 0 else s))
            e = max(-1, min(n - 1, e + n if e < 0 else e))
            count = max(0, (s - e + (-st) - 1) // (-st))
            last = s - (count - 1) * (-st) if count else s
            index[a] = slice(last, s + 1, -st) if count else slice(0, 0)
            flips.append(a)
    out = x[tuple(index)]
    return [out.flip(flips) if flips else out]


@register("Expand", INJ, host_inputs=(1,))
def expand(attrs, xs):
    x, shape = xs
    rank = max(x.dim(), len(shape))
    xshape = [1] * (rank - x.dim()) + list(x.shape)
    shape = [1] * (rank - len(shape)) + list(shape)
    target = [max(a, b) if 1 in (a, b) else b for a, b in zip(xshape, shape)]
    return [x.reshape(xshape).expand(target)]


@register("ConstantOfShape", INJ, host_inputs=(0,))
def constant_of_shape(attrs, xs):
    value = attrs.get("value")
    if value is None:
        return [torch.zeros(list(xs[0]), dtype=torch.float32)]
    t = torch.from_numpy(np.array(value)).reshape(())   # a copy: attribute arrays are read-only
    return [t.expand(list(xs[0])).clone()]


@register("Range", INJ)
def range_(attrs, xs):
    """Scalars as tensors (not host values) so the output keeps their dtype (int32 stays int32)."""
    start, limit, delta = (torch.as_tensor(x) for x in xs)
    cast = int if not start.is_floating_point() else float
    return [torch.arange(cast(start), cast(limit), cast(delta), dtype=start.dtype)]


@register("Split", INJ, host_inputs=(1,))
def split(attrs, xs):
    x = xs[0]
    axis = attrs.get("axis", 0)
    sizes = xs[1] if len(xs) > 1 and xs[1] is not None else attrs.get("split")
    if sizes is None:
        n = attrs["num_outputs"]
        chunk = -(-x.shape[axis] // n)
        return list(torch.split(x, chunk, dim=axis))
    return list(torch.split(x, list(sizes), dim=axis))


@register("Tile", INJ, host_inputs=(1,))
def tile(attrs, xs):
    return [xs[0].repeat(*xs[1])]


def pad_widths(rank: int, pads, axes=None) -> list[int]:
    """Pad's widths for every axis of a rank-`rank` input, [begins..., ends...], from its `pads` over `axes` (all
    axes when None; negative axes count from the end)."""
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        full[a], full[a + rank] = int(pads[i]), int(pads[i + len(axes)])
    return full


@register("Pad", INJ, host_inputs=(1, 2, 3))
def pad(attrs, xs):
    from kiln.ops.nn import _torch_pad

    x = xs[0]
    pads = list(xs[1]) if len(xs) > 1 and xs[1] is not None else list(attrs["pads"])
    value = xs[2] if len(xs) > 2 and xs[2] is not None else attrs.get("value", 0.0)
    if isinstance(value, list):
        value = value[0] if value else 0.0
    full = pad_widths(x.dim(), pads, xs[3] if len(xs) > 3 else None)
    mode = attrs.get("mode", "constant")
    tpads = _torch_pad(full)
    if mode == "constant":
        return [torch.nn.functional.pad(x, tpads, value=value)]
    mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
    spatial = tpads[: 2 * (x.dim() - 2)]
    return [torch.nn.functional.pad(x, spatial, mode=mode)]
