"""Index-driven ONNX ops (gather/scatter variants, cumulative sums, triangles, one-hot, depth<->space) and the
floating-point predicates exports add around them (IsNaN, IsInf), in torch. Every op also runs on meta tensors
(shape inference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.dtypes import onnx_to_numpy, to_torch_dtype
from kiln.ops.registry import OpKind, register

INJ, E, OPAQUE = OpKind.INJECTIVE, OpKind.ELEMENTWISE, OpKind.OPAQUE


def _wrap(idx: torch.Tensor, size) -> torch.Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


@register("GatherND", INJ)
def gather_nd(attrs, xs):
    data, idx = xs
    b = attrs.get("batch_dims", 0)
    k = idx.shape[-1]
    out_shape = tuple(idx.shape[:-1]) + tuple(data.shape[b + k:])
    if data.device.type == "meta" or idx.device.type == "meta":
        return [torch.empty(out_shape, dtype=data.dtype, device="meta")]
    batch = int(torch.tensor(data.shape[:b]).prod()) if b else 1
    flat = data.reshape((batch,) + tuple(data.shape[b:]))
    index = idx.reshape(batch, -1, k)
    cols = [_wrap(index[..., j], data.shape[b + j]) for j in range(k)]
    rows = torch.arange(batch).reshape(batch, 1).expand_as(cols[0]) if cols else torch.arange(batch)
    return [flat[(rows, *cols)].reshape(out_shape)]


@register("GatherElements", INJ)
def gather_elements(attrs, xs):
    data, idx = xs
    axis = attrs.get("axis", 0) % data.dim()
    return [torch.gather(data, axis, _wrap(idx, data.shape[axis]))]


def _reduce(reduction: str):
    return {"none": None, "add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[reduction]


@register("ScatterElements", INJ)
def scatter_elements(attrs, xs):
    data, idx, updates = xs
    axis = attrs.get("axis", 0) % data.dim()
    idx = _wrap(idx, data.shape[axis])
    reduce = _reduce(attrs.get("reduction", "none"))
    if reduce is None:
        return [data.scatter(axis, idx, updates)]
    return [data.scatter_reduce(axis, idx, updates, reduce, include_self=True)]


@register("ScatterND", INJ)
def scatter_nd(attrs, xs):
    data, idx, updates = xs
    if data.device.type == "meta" or idx.device.type == "meta":
        return [torch.empty_like(data, device="meta")]
    k = idx.shape[-1]
    index = idx.reshape(-1, k)
    cols = tuple(_wrap(index[:, j], data.shape[j]) for j in range(k))
    vals = updates.reshape((index.shape[0],) + tuple(data.shape[k:]))
    out = data.clone()
    reduction = attrs.get("reduction", "none")
    if reduction == "none":
        out[cols] = vals
    elif reduction == "add":
        out.index_put_(cols, vals, accumulate=True)
    else:
        for i in range(index.shape[0]):   # mul/max/min: sequential, as the spec defines them
            pos = tuple(c[i] for c in cols)
            out[pos] = {"mul": torch.mul, "max": torch.maximum, "min": torch.minimum}[reduction](out[pos], vals[i])
    return [out]


@register("CumSum", OPAQUE, host_inputs=(1,))
def cumsum(attrs, xs):
    x, axis = xs[0], int(torch.as_tensor(xs[1]).reshape(-1)[0])
    axis %= x.dim()
    if attrs.get("reverse", 0):
        x = x.flip(axis)
    y = torch.cumsum(x, axis).to(x.dtype)
    if attrs.get("exclusive", 0):
        y = y - x
    return [y.flip(axis) if attrs.get("reverse", 0) else y]


@register("Trilu", INJ, host_inputs=(1,))
def trilu(attrs, xs):
    x = xs[0]
    k = int(torch.as_tensor(xs[1]).reshape(-1)[0]) if len(xs) > 1 and xs[1] is not None else 0
    return [torch.triu(x, k) if attrs.get("upper", 1) else torch.tril(x, k)]


@register("OneHot", INJ, host_inputs=(1,))
def one_hot(attrs, xs):
    idx, depth, values = xs
    depth = int(torch.as_tensor(depth).reshape(-1)[0])
    axis = attrs.get("axis", -1)
    axis = axis % (idx.dim() + 1)
    off, on = values[0], values[1]
    if idx.device.type == "meta":
        shape = list(idx.shape)
        shape.insert(axis, depth)
        return [torch.empty(shape, dtype=values.dtype, device="meta")]
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + depth, idx)
    valid = (idx >= 0) & (idx < depth)
    hot = F.one_hot(torch.where(valid, idx, 0), depth) * valid.unsqueeze(-1)
    out = torch.where(hot.bool(), on, off)
    return [out.movedim(-1, axis)]


@register("DepthToSpace", INJ)
def depth_to_space(attrs, xs):
    x, b = xs[0], attrs["blocksize"]
    n, c, h, w = x.shape
    if attrs.get("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return [y.reshape(n, c // (b * b), h * b, w * b)]


@register("SpaceToDepth", INJ)
def space_to_depth(attrs, xs):
    x, b = xs[0], attrs["blocksize"]
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return [y.reshape(n, c * b * b, h // b, w // b)]


@register("EyeLike", INJ)
def eye_like(attrs, xs):
    x = xs[0]
    dtype = to_torch_dtype(onnx_to_numpy(attrs["dtype"], "EyeLike")) if "dtype" in attrs else x.dtype
    n, m = x.shape
    k = attrs.get("k", 0)
    if x.device.type == "meta":
        return [torch.empty((n, m), dtype=dtype, device="meta")]
    return [torch.ones(n, m, dtype=dtype).triu(k).tril(k)]


@register("IsNaN", E)
def is_nan(attrs, xs):
    return [torch.isnan(xs[0])]


@register("IsInf", E)
def is_inf(attrs, xs):
    x = xs[0]
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    return [(torch.isposinf(x) & bool(pos)) | (torch.isneginf(x) & bool(neg))]


@register("TensorScatter", INJ)
def tensor_scatter(attrs, xs):
    """TensorScatter (opset 24): the KV cache `past` with `update` written along `axis` from each batch row's
    write index (0 without write_indices; modulo the cache length in "circular" mode)."""
    past, update = xs[0], xs[1]
    axis = attrs.get("axis", -2) % past.dim()
    mode = attrs.get("mode", "linear")
    if axis == 0 or mode not in ("linear", "circular"):
        raise ValueError(f"TensorScatter: axis {attrs.get('axis', -2)} / mode {mode!r} (axis must not be the batch "
                         "axis; mode is linear or circular)")
    batch, length, count = past.shape[0], past.shape[axis], update.shape[axis]
    if update.dim() != past.dim() or count > length or any(
            a != b for i, (a, b) in enumerate(zip(past.shape, update.shape)) if i != axis):
        raise ValueError(f"TensorScatter: update {list(update.shape)} does not fit the cache {list(past.shape)} "
                         f"(equal but for axis {axis}, where it is at most as long)")
    if past.device.type == "meta" or update.device.type == "meta":
        return [torch.empty_like(past, device="meta")]
    starts = xs[2].to(torch.int64) if len(xs) > 2 and xs[2] is not None else torch.zeros(batch, dtype=torch.int64)
    positions = starts.reshape(batch, 1) + torch.arange(count, dtype=torch.int64)
    if mode == "circular":
        positions = positions % length
    elif count and (int(positions.min()) < 0 or int(positions.max()) >= length):
        raise ValueError(f"TensorScatter: write indices {starts.tolist()} + {count} updates run past the cache's "
                         f"{length} positions (mode linear)")
    shape = [batch] + [1] * (axis - 1) + [count] + [1] * (past.dim() - axis - 1)
    return [past.scatter(axis, positions.reshape(shape).expand(update.shape), update)]
