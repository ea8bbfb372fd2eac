"""kiln's fused Attention layer in C (kiln/native/csrc/attention.c): softmax(Q·Kᵀ·scale + mask)·V per (batch,
head). Q, K, V and the additive mask are read in place through their strides — BERT's Q, K and V are slices of one
fused QKV output, reshaped and transposed, so they are views, never copied (a view without unit inner stride is
copied first) — and the output is written straight into the layout the layer's `out_steps` give it.

`kiln.attention_c` computes in FP32; `kiln.attention_c_bf16` multiplies bf16 operands on vdpbf16ps with FP32
accumulation (Q, K, V and P rounded to bf16) and keeps the softmax and its row sums in FP32. Both read Q, K, V and
write the output in FP32 or bf16, as the plan stores them (kiln.tactics.storage). Grouped-query attention's K and
V (each K/V head expanded across its group of query heads by stride 0, then reshaped to the query heads) are read
in place, one head per group (`kv_group`). Each input geometry (shapes, strides, dtypes) is worked out once and
cached, so a call costs its key, a dictionary lookup, one output allocation and the C call.

BERT-base's layer (12 heads of 128 x 64, a 1x1x128x128 mask), 2 threads of a Zen 4: torch's SDPA 0.49 ms,
kiln.attention_c 0.31 ms, kiln.attention_c_bf16 0.20 ms (docs/tactics.md). A call on a tiny layer costs ~4.7 µs.
"""
from __future__ import annotations

import ctypes
import functools
import json
from dataclasses import dataclass
from typing import Callable

import torch

from kiln import hardware, native
from kiln.ops import lookup
from kiln.ops.fused import apply_steps
from kiln.tactics.base import (ANY, HWC, LINEAR, STORED_FLOATS, Kernel, LayerView, storage_dtype, stored_channel_major,
                               unit_inner)
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA

ATTENTION_TACTIC = "kiln.attention_c"
ATTENTION_BF16_TACTIC = "kiln.attention_c_bf16"
Q_BF16, K_BF16, V_BF16, OUT_BF16, NAN_TO_ZERO = 1, 2, 4, 8, 16   # attention.c's AttnCall.flags
GEOMETRY_FIELDS = ("batch", "heads", "sq", "sk", "d", "dv", "q_b", "q_h", "q_s", "k_b", "k_h", "k_s",
                   "v_b", "v_h", "v_s", "m_b", "m_h", "m_q", "m_k", "o_b", "o_h", "o_s",
                   "q_at", "k_at", "v_at", "m_at", "kv_group")


class AttnCall(ctypes.Structure):
    """attention.c's AttnCall, field by field: sizes and element strides, each operand's byte offset from the
    pointer passed for it, the scale, the flags."""

    _fields_ = [(name, ctypes.c_int64) for name in GEOMETRY_FIELDS] + [("scale", ctypes.c_float),
                                                                       ("flags", ctypes.c_int32)]


@dataclass(frozen=True)
class Operands:
    """What the kernel reads: Q [B, H, Sq, D], K [B, H / G, Sk, D], V [B, H / G, Sk, Dv] with unit inner stride
    (stride 0 along broadcast axes; query head h reads K/V head h // G, G = `kv_group`), the FP32 mask expanded to
    [B, H, Sq, Sk] or None, and the shape of the attention output before `out_steps` (the rank the layer's
    broadcasting gives it)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    out_shape: tuple[int, ...]
    kv_group: int = 1


def _four_dims(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def operands(attrs: dict, xs: list) -> Operands | None:
    """The layer's inputs after their steps as the kernel reads them; None where it cannot (more than two leading
    axes, empty axes, shapes that do not broadcast)."""
    q = viewed_steps(xs[0], attrs.get("q_steps", []))
    (k, v), group = _kv_views(xs[1], attrs.get("k_steps", []), xs[2], attrs.get("v_steps", []))
    k = k.transpose(-1, -2)
    mask = xs[3] if len(xs) > 3 else None
    if min(q.dim(), k.dim(), v.dim()) < 2 or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return None
    sq, sk = q.shape[-2], k.shape[-2]
    heads = [q.shape[:-2], _query_heads(k, group), _query_heads(v, group)] + \
        ([mask.shape[:-2]] if mask is not None else [])
    try:
        lead = tuple(torch.broadcast_shapes(*heads))
        if mask is not None:
            mask = mask.to(torch.float32).expand(*lead, sq, sk)
    except RuntimeError:
        return None
    if len(lead) > 2 or 0 in (*lead, sq, sk, q.shape[-1], v.shape[-1]):
        return None
    kv_lead = (*lead[:-1], lead[-1] // group) if group > 1 else lead
    four = [_four_dims(unit_inner(t.expand(*shape, *t.shape[-2:]))) for t, shape in ((q, lead), (k, kv_lead),
                                                                                       (v, kv_lead))]
    return Operands(*four, None if mask is None else _four_dims(mask), (*lead, sq, v.shape[-1]), group)


def _query_heads(t: torch.Tensor, group: int) -> torch.Size:
    """The leading axes of a K or V operand as the query heads see them: its head axis times the group."""
    return t.shape[:-2] if group == 1 else torch.Size((*t.shape[:-3], t.shape[-3] * group))


def _kv_views(k: torch.Tensor, k_steps: list[dict], v: torch.Tensor, v_steps: list[dict]):
    """((K, V), G): K and V after their steps, as views [.., H / G, S, D] with one head per group of G query heads
    where the steps expand each K/V head across its group (grouped-query attention: a stride-0 axis merged into
    the heads, which no view of [.., H, S, D] gives), else ((K, V) after the steps, 1)."""
    grouped = [_grouped_view(x, steps) for x, steps in ((k, k_steps), (v, v_steps))]
    if grouped[0] is not None and grouped[1] is not None and grouped[0][1] == grouped[1][1]:
        return (grouped[0][0], grouped[1][0]), grouped[0][1]
    return (viewed_steps(k, k_steps), viewed_steps(v, v_steps)), 1


def _grouped_view(x: torch.Tensor, steps: list[dict]) -> tuple[torch.Tensor, int] | None:
    """(the view [.., H / G, a, b] of `x`, G) where the steps repeat each of its heads G times (and give no view
    themselves), else None."""
    if x.device.type == "meta" or not steps or x.numel() <= 1:
        return None
    key = (tuple(x.shape), tuple(x.stride()), json.dumps(steps))
    if _strided_grid(*key) is not None:
        return None
    grid = _grouped_grid(*key)
    if grid is None:
        return None
    shape, strides, first, group = grid
    return x.as_strided(shape, strides, x.storage_offset() + first), group


def viewed_steps(x: torch.Tensor, steps: list[dict]) -> torch.Tensor:
    """`x` after `steps`, as a view of `x` wherever the result is one, even where a step on the way copies: a
    batch-first nn.MultiheadAttention's [B, S, 3D] projection goes through [S, B*H, Dh], which no view gives, on
    its way to Q [B, H, S, Dh], which is a strided view. Where a copy it is, the steps' copy."""
    if x.device.type == "meta" or not steps or x.numel() <= 1:
        return apply_steps(x, steps)
    grid = _strided_grid(tuple(x.shape), tuple(x.stride()), json.dumps(steps))
    if grid is None:
        return apply_steps(x, steps)
    shape, strides, first = grid
    return x.as_strided(shape, strides, x.storage_offset() + first)


@functools.lru_cache(maxsize=256)
def _strided_grid(shape: tuple[int, ...], stride: tuple[int, ...], steps: str) -> tuple | None:
    """(shape, strides, offset) of the view of a tensor of `shape` and `stride` that the steps (JSON) give, or None
    where they give no view of it: the steps run once on the tensor's element offsets, which must form a strided
    grid. Worked out once per geometry (a call with the same one finds it here)."""
    offsets, span = _step_offsets(shape, stride, steps)
    return _grid(offsets, span)


@functools.lru_cache(maxsize=256)
def _grouped_grid(shape: tuple[int, ...], stride: tuple[int, ...], steps: str) -> tuple | None:
    """(shape, strides, offset, G) of the view [.., H / G, a, b] whose head j the steps' heads j*G .. j*G + G - 1
    all repeat (the largest such G > 1), or None where the steps' result has no such groups."""
    offsets, span = _step_offsets(shape, stride, steps)
    if offsets.dim() < 3:
        return None
    heads, firsts = offsets.shape[-3], offsets[..., 0, 0]   # each head's first offset: a cheap test first
    for group in range(heads, 1, -1):
        if heads % group or not bool((firsts.unflatten(-1, (heads // group, group)).diff(dim=-1) == 0).all()):
            continue
        split = offsets.unflatten(-3, (heads // group, group))
        first = split.select(-3, 0)
        if torch.equal(split, first.unsqueeze(-3).expand_as(split)):
            grid = _grid(first.contiguous(), span)
            return None if grid is None else (*grid, group)
    return None


def _step_offsets(shape: tuple[int, ...], stride: tuple[int, ...], steps: str) -> tuple[torch.Tensor, int]:
    """The element offsets (into a tensor of `shape` and `stride`) that the steps (JSON) place at each position of
    their result, contiguous, and the span of offsets the tensor covers."""
    span = sum((n - 1) * st for n, st in zip(shape, stride)) + 1
    return apply_steps(torch.arange(span).as_strided(shape, stride), json.loads(steps)).contiguous(), span


def _grid(offsets: torch.Tensor, span: int) -> tuple | None:
    """(shape, strides, offset) of the strided view of a span of elements that `offsets` name, or None where they
    form no strided grid in it."""
    if offsets.numel() <= 1:
        return None
    first = int(offsets.reshape(-1)[0])
    strides = [int(offsets.select(k, 1).reshape(-1)[0]) - first if n > 1 else 0 for k, n in enumerate(offsets.shape)]
    last = first + sum((n - 1) * st for n, st in zip(offsets.shape, strides))
    if min(strides) < 0 or not 0 <= first <= last < span:
        return None
    if not torch.equal(torch.arange(span).as_strided(offsets.shape, strides, first), offsets):
        return None
    return tuple(offsets.shape), tuple(strides), first


def output_view(y: torch.Tensor, out_steps: list[dict], out_shape: tuple[int, ...]) -> torch.Tensor | None:
    """The view of `y` (the layer's output, contiguous) that `out_steps` turn into `y`, shaped `out_shape`: the
    steps undone as views; None where one cannot be (a slice, a reshape that would copy)."""
    shapes, t = [], torch.empty(out_shape, device="meta")
    for step in out_steps:
        shapes.append(tuple(t.shape))
        t = apply_steps(t, [step])
    view = y
    for step, before in zip(reversed(out_steps), reversed(shapes)):
        if "transpose" in step:
            perm = step["transpose"]
            view = view.permute(*sorted(range(len(perm)), key=perm.__getitem__))
        elif "reshape" in step:
            try:
                view = view.view(before)
            except RuntimeError:
                return None
        else:
            return None
    return view if tuple(view.shape) == tuple(out_shape) and (view.shape[-1] <= 1 or view.stride(-1) == 1) else None


def _attn_call(ops: Operands, out4: torch.Tensor, offsets: tuple[int, ...], scale: float, flags: int) -> AttnCall:
    m = ops.mask.stride() if ops.mask is not None else (0, 0, 0, 0)
    batch, heads, sq, d = ops.q.shape
    values = (batch, heads, sq, ops.k.shape[2], d, ops.v.shape[3], *ops.q.stride()[:3], *ops.k.stride()[:3],
              *ops.v.stride()[:3], *m, *out4.stride()[:3], *offsets, ops.kv_group)
    return AttnCall(*values, scale, flags)


@dataclass(frozen=True)
class CallGeometry:
    """One input geometry worked out: the C call's constants, where the output goes, and whether the operands are
    views of the inputs (the C call then takes the inputs' own addresses, `AttnCall` holding each operand's byte
    offset; else they are rebuilt, copies included, on every call)."""

    call: AttnCall | None             # None: the reference kernel runs this geometry
    call_ref: object                  # ctypes.byref(call), made once
    in_place: bool
    new_output: Callable[[], torch.Tensor] | None   # allocates y (channel-major where the inputs are)
    direct: bool                      # y is the layer's output (else out_steps are applied to it)


def _pointers(ops: Operands) -> list[int]:
    return [ops.q.data_ptr(), ops.k.data_ptr(), ops.v.data_ptr(), 0 if ops.mask is None else ops.mask.data_ptr()]


def call_geometry(attrs: dict, xs: list, out_dtype: torch.dtype, flags: int) -> CallGeometry:
    """The CallGeometry for inputs shaped, strided and typed like `xs`."""
    ops = operands(attrs, xs)
    if ops is None:
        return CallGeometry(None, None, False, None, False)
    steps = attrs.get("out_steps", [])
    final = tuple(apply_steps(torch.empty(ops.out_shape, device="meta"), steps).shape)
    # a channel-major 4-D input (a VAE's attention between 1x1 convolutions): a channel-major output, no Reformat
    layout = torch.channels_last if len(final) == 4 and any(stored_channel_major(x) for x in xs[:3]) else \
        torch.contiguous_format
    out4 = output_view(torch.empty(final, dtype=out_dtype, memory_format=layout), steps, ops.out_shape)
    direct = out4 is not None and out4.storage_offset() == 0
    if not direct:
        out4 = torch.empty(ops.out_shape, dtype=out_dtype)
    dtypes = (ops.q.dtype, ops.k.dtype, ops.v.dtype)
    flags |= sum(bit for bit, dt in zip((Q_BF16, K_BF16, V_BF16), dtypes) if dt == torch.bfloat16)
    flags |= OUT_BF16 if out_dtype == torch.bfloat16 else 0
    pointers = _pointers(ops)
    offsets = [p - x.data_ptr() if x is not None and p and _shares(x, p) else None for x, p in zip(xs, pointers)]
    in_place = all(o is not None for o, p in zip(offsets, pointers) if p)
    at = tuple(o or 0 for o in offsets) + (0,) * (4 - len(offsets)) if in_place else (0, 0, 0, 0)
    call = _attn_call(ops, _four_dims(out4), at, float(attrs["scale"]), flags)
    if direct and layout is torch.channels_last:
        new_output = functools.partial(torch.empty, final, dtype=out_dtype, memory_format=layout)
    else:   # empty_like of a broadcast scalar: ~0.5 µs a call cheaper than torch.empty with its keywords
        template = torch.empty((), dtype=out_dtype).expand(final if direct else ops.out_shape)
        new_output = functools.partial(torch.empty_like, template)
    return CallGeometry(call, ctypes.byref(call), in_place, new_output, direct)


def input_addresses(xs: list) -> list[int]:
    """The addresses the C call takes for Q, K, V and the mask where the operands are views of the inputs (0: no
    mask)."""
    return [0 if x is None else x.data_ptr() for x in xs] + [0] * (4 - len(xs))


def _shares(x: torch.Tensor, ptr: int) -> bool:
    """Whether address `ptr` lies in `x`'s storage (the operand is a view of it, not a copy)."""
    start = x.untyped_storage().data_ptr()
    return start <= ptr < start + x.untyped_storage().nbytes()


class AttentionTactic:
    """FP32 math, FP32 or bf16 storage."""

    name = ATTENTION_TACTIC
    source = "kiln"
    needs_c_compiler = True
    outputs_as_planned = True   # channel-major where a 4-D input is (output_format); the runtime holds it to that
    entry_point = "kiln_attention"
    bf16_inputs = frozenset({0, 1, 2})   # Q, K, V as the plan stores them; the mask stays FP32
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Attention" or layer.domain != "kiln" or len(layer.output_dtypes) != 1 \
                or layer.output_dtypes[0] not in STORED_FLOATS or len(layer.input_shapes) < 3:
            return False
        if any(layer.input_dtypes[i] not in STORED_FLOATS or layer.input_shapes[i] is None for i in range(3)):
            return False
        metas = [torch.empty(s, device="meta") for s in layer.input_shapes[:3]]
        if len(layer.input_shapes) > 3 and layer.input_shapes[3] is not None:
            if layer.input_dtypes[3] not in ("float16", "bfloat16", "float32", "float64"):
                return False
            metas.append(torch.empty(layer.input_shapes[3], device="meta"))
        try:
            ops = operands(layer.attrs, metas)
        except RuntimeError:   # steps that do not apply to these shapes
            return False
        return ops is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY] * len(layer.input_shapes)   # read in place through their strides, in either layout

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        if HWC not in input_formats[:3]:
            return LINEAR
        ops = operands(layer.attrs, [torch.empty(s, device="meta") for s in layer.input_shapes[:3]])
        final = apply_steps(torch.empty(ops.out_shape, device="meta"), layer.attrs.get("out_steps", []))
        return HWC if final.dim() == 4 else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        entry = getattr(native.library("attention"), self.entry_point)
        attrs, out_dtype = layer.attrs, storage_dtype(layer.output_dtypes[0])
        flags = NAN_TO_ZERO if attrs.get("nan_to_zero") else 0
        consts = {i: (t.float().contiguous() if i == 3 else t) for i, t in layer.const_inputs.items()}
        reference = lookup("Attention", "kiln").impl
        geometries: dict[tuple, CallGeometry] = {}
        signature, addresses = _readers(layer)

        def run(xs):
            xs = [consts.get(i, x) for i, x in enumerate(xs)] if consts else xs
            key = signature(xs)
            geo = geometries.get(key)
            if geo is None:
                geo = geometries.setdefault(key, call_geometry(attrs, xs, out_dtype, flags))
            if geo.call is None:   # a geometry the kernel does not take: torch's kernel, in FP32
                wide = [x.float() if x is not None and x.is_floating_point() else x for x in xs]
                return [y.to(out_dtype) for y in reference(attrs, wide)]
            y = geo.new_output()
            if geo.in_place:
                entry(geo.call_ref, *addresses(xs), y.data_ptr())
            else:
                ops = operands(attrs, xs)   # holds the copies until the call returns
                entry(geo.call_ref, *_pointers(ops), y.data_ptr())
            return [y] if geo.direct else [apply_steps(y, attrs.get("out_steps", []))]
        return run


def _signature(xs: list) -> tuple:
    """What decides a call's geometry: each input's shape, strides and dtype."""
    return tuple([None if x is None else (x.shape, x.stride(), x.dtype) for x in xs])


def _signature_qkvm(xs: list) -> tuple:
    q, k, v, m = xs
    return (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
            m.shape, m.stride(), m.dtype)


def _signature_qkv(xs: list) -> tuple:
    q, k, v = xs
    return (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype)


def _addresses_qkvm(xs: list) -> tuple[int, ...]:
    q, k, v, m = xs
    return q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr()


def _addresses_qkv(xs: list) -> tuple[int, ...]:
    q, k, v = xs
    return q.data_ptr(), k.data_ptr(), v.data_ptr(), 0


def _readers(layer: LayerView):
    """(signature, addresses) for the layer's calls: written out for Q, K, V with or without a mask, every input
    present (a call's Python work is what a tiny layer costs: ~0.3 µs less than the general loops), else the loops.
    An input missing where the plan has one fails loudly in them (None has no shape)."""
    present = [s is not None for s in layer.input_shapes]
    if present == [True] * 4:
        return _signature_qkvm, _addresses_qkvm
    if present == [True] * 3:
        return _signature_qkv, _addresses_qkv
    return _signature, input_addresses


class AttentionBf16Tactic(AttentionTactic):
    """bf16 operands on vdpbf16ps (AVX512-BF16) with FP32 accumulation, the softmax in FP32."""

    name = ATTENTION_BF16_TACTIC
    entry_point = "kiln_attention_bf16"
    reduced_precisions = frozenset({"BF16"})
    required_isa = BF16_DOT_ISA

    def supports(self, layer: LayerView) -> bool:
        return hardware.has_any(BF16_DOT_ISA) and super().supports(layer)
