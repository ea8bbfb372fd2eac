"""Neural-network ONNX ops: convolution, pooling, GEMM/MatMul, softmax and reductions, in torch."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.registry import OpKind, register

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def resolve_auto_pad(auto_pad: str, in_spatial, kernel, strides, dilations, pads) -> list[int]:
    """Explicit [begin..., end...] pads for ONNX `auto_pad` (SAME_UPPER puts the odd pixel at the end)."""
    n = len(kernel)
    if auto_pad in ("", "NOTSET"):
        return list(pads) if pads else [0] * (2 * n)
    if auto_pad == "VALID":
        return [0] * (2 * n)
    begin, end = [], []
    for size, k, s, d in zip(in_spatial, kernel, strides, dilations):
        out = math.ceil(size / s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin + end


def _torch_pad(pads: list[int]) -> list[int]:
    """ONNX [b1, b2, e1, e2] -> torch F.pad order (last dim first)."""
    n = len(pads) // 2
    out: list[int] = []
    for i in reversed(range(n)):
        out += [pads[i], pads[i + n]]
    return out


def _split_pads(x, pads, n, value=0.0):
    """Return (x, symmetric padding) applying any asymmetric part explicitly."""
    begin, end = list(pads[:n]), list(pads[n:])
    if begin == end:
        return x, begin
    return F.pad(x, _torch_pad(pads), value=value), [0] * n


def apply_activation(spec, x):
    """kiln extension: a fused activation, given as {"op": ONNX op type, "attrs": {...}}."""
    if not spec:
        return x
    from kiln.ops.registry import OPS

    return OPS[spec["op"]].impl(spec.get("attrs", {}), [x])[0]


@register("Conv", OpKind.COMPLEX, trt_layer="Convolution")
def conv(attrs, xs):
    """ONNX Conv; kiln's fused form adds input 3 (residual summed before the activation) and `activation`."""
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    n = w.dim() - 2
    pads = attrs.get("pads") or [0] * (2 * n)
    x, padding = _split_pads(x, pads, n)
    y = _CONV[n](x, w, b, attrs.get("strides") or [1] * n, padding,
                 attrs.get("dilations") or [1] * n, attrs.get("group", 1))
    if len(xs) > 3 and xs[3] is not None:
        y = y + xs[3]
    return [apply_activation(attrs.get("activation"), y)]


@register("MaxPool", OpKind.REDUCTION, trt_layer="Pooling")
def max_pool(attrs, xs):
    x = xs[0]
    k = attrs["kernel_shape"]
    n = len(k)
    pads = attrs.get("pads") or [0] * (2 * n)
    fits = all(p * 2 <= kk for p, kk in zip(pads, k + k))
    x, padding = _split_pads(x, pads, n, value=float("-inf")) if fits else (
        F.pad(x, _torch_pad(pads), value=float("-inf")), [0] * n)
    return [_MAXPOOL[n](x, k, attrs.get("strides") or [1] * n, padding,
                        attrs.get("dilations") or [1] * n, bool(attrs.get("ceil_mode", 0)))]


@register("AveragePool", OpKind.REDUCTION, trt_layer="Pooling")
def average_pool(attrs, xs):
    x = xs[0]
    k = attrs["kernel_shape"]
    n = len(k)
    strides = attrs.get("strides") or [1] * n
    pads = attrs.get("pads") or [0] * (2 * n)
    include = bool(attrs.get("count_include_pad", 0))
    ceil = bool(attrs.get("ceil_mode", 0))
    begin, end = pads[:n], pads[n:]
    if begin == end and all(p * 2 <= kk for p, kk in zip(begin, k)):
        return [_AVGPOOL[n](x, k, strides, begin, ceil, include)]
    # asymmetric padding: sum-pool the zero-padded input and divide by the (padded or real) element count
    xp = F.pad(x, _torch_pad(pads))
    sums = _AVGPOOL[n](xp, k, strides, 0, ceil, True) * math.prod(k)
    mask = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    mask = F.pad(mask, _torch_pad(pads), value=1.0 if include else 0.0)
    counts = _AVGPOOL[n](mask, k, strides, 0, ceil, True) * math.prod(k)
    return [sums / counts]


@register("GlobalAveragePool", OpKind.REDUCTION, trt_layer="Pooling")
def global_average_pool(attrs, xs):
    x = xs[0]
    return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]


@register("GlobalMaxPool", OpKind.REDUCTION, trt_layer="Pooling")
def global_max_pool(attrs, xs):
    x = xs[0]
    return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]


@register("Gemm", OpKind.COMPLEX, trt_layer="MatrixMultiply")
def gemm(attrs, xs):
    a, b = xs[0], xs[1]
    c = xs[2] if len(xs) > 2 else None
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    out = torch.matmul(a, b)
    if alpha != 1.0:
        out = out * alpha
    if c is not None:
        out = out + (c * beta if beta != 1.0 else c)
    return [apply_activation(attrs.get("activation"), out)]


@register("MatMul", OpKind.COMPLEX, trt_layer="MatrixMultiply")
def matmul(attrs, xs):
    """ONNX MatMul; kiln's fused form adds input 2 (bias) and `activation`."""
    out = torch.matmul(xs[0], xs[1])
    if len(xs) > 2 and xs[2] is not None:
        out = out + xs[2]
    return [apply_activation(attrs.get("activation"), out)]


@register("Softmax", OpKind.REDUCTION, trt_layer="SoftMax")
def softmax(attrs, xs):
    return [torch.softmax(xs[0], dim=attrs.get("axis", -1))]


@register("LogSoftmax", OpKind.REDUCTION, trt_layer="SoftMax")
def log_softmax(attrs, xs):
    return [torch.log_softmax(xs[0], dim=attrs.get("axis", -1))]


def _reduce_axes(attrs, xs, rank):
    axes = xs[1] if len(xs) > 1 and xs[1] is not None else attrs.get("axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return None
        return list(range(rank))
    return [a % rank for a in axes]


def _reduce(op_type: str, fn):
    def impl(attrs, xs):
        x = xs[0]
        axes = _reduce_axes(attrs, xs, x.dim())
        if axes is None:
            return [x]
        keep = bool(attrs.get("keepdims", 1))
        return [fn(x, tuple(axes), keep)]
    register(op_type, OpKind.REDUCTION, host_inputs=(1,), trt_layer="Reduce")(impl)


_reduce("ReduceMean", lambda x, d, k: x.mean(dim=d, keepdim=k))
_reduce("ReduceSum", lambda x, d, k: x.sum(dim=d, keepdim=k))
_reduce("ReduceMax", lambda x, d, k: x.amax(dim=d, keepdim=k))
_reduce("ReduceMin", lambda x, d, k: x.amin(dim=d, keepdim=k))
_reduce("ReduceProd", lambda x, d, k: _prod(x, d, k))
_reduce("ReduceL2", lambda x, d, k: torch.sqrt((x * x).sum(dim=d, keepdim=k)))
_reduce("ReduceSumSquare", lambda x, d, k: (x * x).sum(dim=d, keepdim=k))


def _prod(x, dims, keep):
    for d in sorted(dims, reverse=True):
        x = x.prod(dim=d, keepdim=keep)
    return x


@register("Einsum", OpKind.COMPLEX, trt_layer="Einsum")
def einsum(attrs, xs):
    return [torch.einsum(attrs["equation"].replace(" ", ""), *xs)]


@register("TopK", OpKind.REDUCTION, host_inputs=(1,), trt_layer="TopK")
def topk(attrs, xs):
    x, k = xs[0], int(xs[1][0] if isinstance(xs[1], list) else xs[1])
    values, indices = torch.topk(x, k, dim=attrs.get("axis", -1), largest=bool(attrs.get("largest", 1)),
                                 sorted=True)
    return [values, indices.to(torch.int64)]


def _arg_reduce(largest: bool):
    def impl(attrs, xs):
        x = xs[0]
        axis = attrs.get("axis", 0) % x.dim()
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):
            flipped = x.flip(axis)
            idx = (flipped.argmax if largest else flipped.argmin)(dim=axis, keepdim=keep)
            return [(x.shape[axis] - 1 - idx).to(torch.int64)]
        return [(x.argmax if largest else x.argmin)(dim=axis, keepdim=keep).to(torch.int64)]
    return impl


register("ArgMax", OpKind.REDUCTION, trt_layer="TopK")(_arg_reduce(True))
register("ArgMin", OpKind.REDUCTION, trt_layer="TopK")(_arg_reduce(False))
