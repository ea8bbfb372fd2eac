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


@register("Conv", OpKind.COMPLEX)
def conv(attrs, xs):
    """ONNX Conv; kiln's fused form adds input 3 (residual summed before the activation) and `activation`."""
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    n = w.dim() - 2
    pads = attrs.get("pads") or [0] * (2 * n)
    x, padding = _split_pads(x, pads, n)
    y = _CONV[n](x, w, b, attrs.get("strides") or [1] * n, padding,
                 attrs.get("dilations") or [1] * n, attrs.get("group", 1))
    return [residual_then_activation(attrs, xs, y)]


@register("MaxPool", OpKind.REDUCTION)
def max_pool(attrs, xs):
    x = xs[0]
    if not x.is_floating_point() and x.element_size() <= 2:
        # INT8 maps between quantized layers: the max of small integers is exact in float32; torch 2.13's integer
        # max_pool2d is ~10x slower (3.1 against 0.37 ms on a 112x112x64 uint8 map) and rejects channels-last
        return [max_pool(attrs, [x.float()])[0].to(x.dtype)]
    k = attrs["kernel_shape"]
    n = len(k)
    pads = attrs.get("pads") or [0] * (2 * n)
    fits = all(p * 2 <= kk for p, kk in zip(pads, k + k))
    x, padding = _split_pads(x, pads, n, value=float("-inf")) if fits else (
        F.pad(x, _torch_pad(pads), value=float("-inf")), [0] * n)
    return [_MAXPOOL[n](x, k, attrs.get("strides") or [1] * n, padding,
                        attrs.get("dilations") or [1] * n, bool(attrs.get("ceil_mode", 0)))]


def pool_output_size(size: int, k: int, s: int, d: int, begin: int, end: int, ceil: bool) -> int:
    """ONNX pooling output length; in ceil mode the last window must start inside the input or its begin pad."""
    span = size + begin + end - d * (k - 1) - 1
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + begin:
        out -= 1
    return out


def _window_sums(x, k, strides, dilations):
    """Sum over every (strided, dilated) pooling window: a depthwise convolution with a ones kernel."""
    planes = x.reshape(-1, 1, *x.shape[2:])
    ones = torch.ones((1, 1, *k), dtype=x.dtype, device=x.device)
    out = _CONV[len(k)](planes, ones, None, strides, 0, dilations)
    return out.reshape(*x.shape[:2], *out.shape[2:])


@register("AveragePool", OpKind.REDUCTION)
def average_pool(attrs, xs):
    x = xs[0]
    k = attrs["kernel_shape"]
    n = len(k)
    strides = attrs.get("strides") or [1] * n
    dilations = attrs.get("dilations") or [1] * n
    pads = attrs.get("pads") or [0] * (2 * n)
    include = bool(attrs.get("count_include_pad", 0))
    ceil = bool(attrs.get("ceil_mode", 0))
    begin, end = pads[:n], pads[n:]
    if begin == end and all(p * 2 <= kk for p, kk in zip(begin, k)) and all(d == 1 for d in dilations):
        return [_AVGPOOL[n](x, k, strides, begin, ceil, include)]
    # asymmetric pads or dilations: window sums of the zero-padded input over the count of elements that
    # count (padding only with count_include_pad; the ceil-mode overhang past the padding never)
    outs = [pool_output_size(*a, ceil) for a in zip(x.shape[2:], k, strides, dilations, begin, end)]
    need = [(o - 1) * s + d * (kk - 1) + 1 for o, s, d, kk in zip(outs, strides, dilations, k)]
    over = _torch_pad([0] * n + [max(0, q - size - b - e) for q, size, b, e in zip(need, x.shape[2:], begin, end)])
    mask = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    mask = F.pad(F.pad(mask, _torch_pad(pads), value=1.0 if include else 0.0), over)
    xp = F.pad(F.pad(x, _torch_pad(pads)), over)
    crop = (slice(None), slice(None), *(slice(0, o) for o in outs))
    return [(_window_sums(xp, k, strides, dilations) / _window_sums(mask, k, strides, dilations))[crop]]


@register("GlobalAveragePool", OpKind.REDUCTION)
def global_average_pool(attrs, xs):
    x = xs[0]
    return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]


@register("GlobalMaxPool", OpKind.REDUCTION)
def global_max_pool(attrs, xs):
    x = xs[0]
    return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]


@register("Gemm", OpKind.COMPLEX)
def gemm(attrs, xs):
    """ONNX Gemm; kiln's fused form adds input 3 (a residual) and `activation`."""
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
    return [residual_then_activation(attrs, xs, out)]


@register("MatMul", OpKind.COMPLEX)
def matmul(attrs, xs):
    """ONNX MatMul; kiln's fused form adds input 2 (bias), input 3 (a residual) and `activation`."""
    out = torch.matmul(xs[0], xs[1])
    if len(xs) > 2 and xs[2] is not None:
        out = out + xs[2]
    return [residual_then_activation(attrs, xs, out)]


def residual_then_activation(attrs, xs, out):
    """A fused product's epilogue after its bias: the residual (input 3, kiln.passes.conv.fuse_residual_add), then
    the activation."""
    if len(xs) > 3 and xs[3] is not None:
        out = out + xs[3]
    return apply_activation(attrs.get("activation"), out)


@register("Softmax", OpKind.REDUCTION)
def softmax(attrs, xs):
    return [torch.softmax(xs[0], dim=attrs.get("axis", -1))]


@register("LogSoftmax", OpKind.REDUCTION)
def log_softmax(attrs, xs):
    return [torch.log_softmax(xs[0], dim=attrs.get("axis", -1))]


def reduce_axes(attrs, xs, rank):
    """A Reduce op's axes in [0, rank): the attribute, or the second input (opset 18); none given: every axis, or None
    under noop_with_empty_axes."""
    axes = xs[1] if len(xs) > 1 and xs[1] is not None else attrs.get("axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return None
        return list(range(rank))
    return [a % rank for a in axes]


def _reduce(op_type: str, fn):
    def impl(attrs, xs):
        x = xs[0]
        axes = reduce_axes(attrs, xs, x.dim())
        if axes is None:
            return [x]
        keep = bool(attrs.get("keepdims", 1))
        return [fn(x, tuple(axes), keep)]
    register(op_type, OpKind.REDUCTION, host_inputs=(1,))(impl)


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


@register("Einsum", OpKind.COMPLEX)
def einsum(attrs, xs):
    return [torch.einsum(attrs["equation"].replace(" ", ""), *xs)]


@register("TopK", OpKind.REDUCTION, host_inputs=(1,))
def topk(attrs, xs):
    """ONNX TopK: of equal values the lower index is taken and listed first, which torch.topk does not promise."""
    x, k = xs[0], int(xs[1][0] if isinstance(xs[1], list) else xs[1])
    axis, largest = attrs.get("axis", -1) % x.dim(), bool(attrs.get("largest", 1))
    values, indices = torch.topk(x, k, dim=axis, largest=largest, sorted=True)
    if k == 0 or x.device.type == "meta" or x.shape[axis] == 0:
        return [values, indices.to(torch.int64)]
    rows, best, top = x.movedim(axis, -1), indices.movedim(axis, -1), values.movedim(axis, -1)
    kth = top[..., k - 1:k]
    if not torch.equal((rows == kth).sum(-1), (top == kth).sum(-1)):   # a tie crosses the k-th place
        best = _lowest_index_set(rows, kth, k, largest)
    if best is None:   # NaNs among the k best: torch's choice and order
        return [values, indices.to(torch.int64)]
    best = best.sort(-1).values
    values, order = torch.sort(torch.gather(rows, -1, best), dim=-1, descending=largest, stable=True)
    return [values.movedim(-1, axis), torch.gather(best, -1, order).movedim(-1, axis).to(torch.int64)]


def _lowest_index_set(rows, kth, k: int, largest: bool):
    """Positions of the k best of each row (last axis), ties at the k-th value going to lower indices."""
    better = rows > kth if largest else rows < kth
    tied = rows == kth
    keep = better | (tied & (tied.cumsum(-1) <= k - better.sum(-1, keepdim=True)))
    if int(keep.sum()) != keep.numel() // rows.shape[-1] * k:
        return None
    return torch.arange(rows.shape[-1], device=rows.device).expand(rows.shape)[keep].reshape(*rows.shape[:-1], k)


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


register("ArgMax", OpKind.REDUCTION)(_arg_reduce(True))
register("ArgMin", OpKind.REDUCTION)(_arg_reduce(False))


WINDOW_OPS = ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "QConv", "DynamicQConv", "LpPool")


def check_window_attrs(op_type: str, attrs: dict) -> str | None:
    """Why a conv/pool's attributes are invalid (native kernels crash on e.g. a zero stride), or None."""
    if op_type not in WINDOW_OPS:
        return None
    for key, least in (("strides", 1), ("dilations", 1), ("kernel_shape", 1), ("pads", 0), ("output_padding", 0)):
        values = attrs.get(key)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and v >= least for v in values):
            return f"{key} must be integers >= {least}, got {values!r}"
    group = attrs.get("group", 1)
    if not isinstance(group, int) or group < 1:
        return f"group must be an integer >= 1, got {group!r}"
    return None
