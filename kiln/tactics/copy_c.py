"""Concat, Slice and Split along one axis in C (reformat.c's `kiln_copy_rows`): in memory order, such a layer
copies, for every row of the axes before the axis, one contiguous chunk per input. Channel-major (NHWC) and
row-major tensors alike, so YOLO's channel splits and concatenations between channel-major convolutions copy
straight, without torch's strided copies.

`kiln.copy_rows` moves FP32 or INT8 bytes (a quantized detector's channel splits and concatenations between its
INT8 convolutions; a QConcat's inputs each through its own table, kiln.passes.qconcat_table);
`kiln.copy_rows_bf16` moves tensors as a BF16 plan stores them, each input FP32 or bf16, each output in the type its
readers take, converting as it copies (torch.cat converting as it copies was 10x slower than converting first, then
concatenating). YOLOv8n's first C2f Concat (16+16+16 channels, 160 x 160, two inputs FP32, output bf16), 2 threads
of a Zen 4: 0.19 ms through torch (convert, then concatenate), 0.08 ms here with hot caches; in the plan 0.21 -> 0.16
ms. All bf16: 0.10 -> 0.05 ms.

Chunks are worked out once at load from the layer's static shapes (the batch is read per call), by running torch's
reference kernel on a probe: the layer's axis holds 0, 1, 2, ..., every other axis is 1, so each output's values
say which elements it takes; only layers taking contiguous ranges (step 1) are offered."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from kiln import native
from kiln.ops import lookup
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import table_bytes
from kiln.tactics.base import ANY, HWC, LINEAR, MEMORY_ORDER, STORED_FLOATS, Bf16Storage, Kernel, LayerView, \
    batch_dynamic_only, storage_dtype
from kiln.tactics.reference import MOVED_INPUTS, ReferenceTactic
from kiln.tactics.reformat import to_format
from kiln.tactics.views import row_step

COPY_TACTIC = "kiln.copy_rows"
COPY_OPS = ("Concat", "Slice", "Split")
LAYOUTS = ((LINEAR, torch.contiguous_format), (HWC, torch.channels_last))   # row-major first: see in_one_layout


class CopyPart(ctypes.Structure):
    """reformat.c's CopyPart: in each row, `count` elements of `src_size` bytes from `src_at` (rows `src_step`
    apart) go to `dst_at`."""

    _fields_ = [(name, ctypes.c_int64) for name in ("src_step", "src_at", "count", "dst_at", "src_size")] + \
        [("table", ctypes.c_void_p)]   # 256 bytes each INT8 byte is mapped through, or NULL


@dataclass(frozen=True)
class Ranges:
    """A layer as ranges along one axis: input i's [start, start + size) goes to [offset, offset + size) of output
    o, for each (o, i, start, size, offset) in `moves`; `extents` are the inputs' and outputs' sizes along it."""

    axis: int
    moves: tuple[tuple[int, int, int, int, int], ...]
    in_extents: tuple[int, ...]
    out_extents: tuple[int, ...]


def copy_layer(layer: LayerView) -> bool:
    """ONNX's Concat, Slice or Split, or kiln's QConcat (a Concat with tables on its inputs)."""
    return (layer.op_type in COPY_OPS and layer.domain in ("", "ai.onnx")) or \
        (layer.op_type == "QConcat" and layer.domain == "kiln")


def concatenates(layer: LayerView) -> bool:
    return layer.op_type in ("Concat", "QConcat")


def layer_ranges(layer: LayerView) -> Ranges | None:
    """The layer as Ranges, or None where it is not one contiguous copy per output along one axis past the batch."""
    shapes = layer.input_shapes
    if not shapes or any(s is None for s in shapes) or not batch_dynamic_only(layer):
        return None
    rank = len(shapes[0])
    if rank < 2:
        return None
    if concatenates(layer):
        axis = layer.attrs.get("axis", 0)
        if not -rank <= axis < rank or any(len(s) != rank for s in shapes):
            return None
        axis %= rank
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s[axis])
        moves = tuple((0, i, 0, s[axis], offsets[i]) for i, s in enumerate(shapes))
        return Ranges(axis, moves, tuple(s[axis] for s in shapes), (offsets[-1],)) if axis > 0 else None
    return _probed_ranges(layer, shapes[0])


def _probed_ranges(layer: LayerView, shape: tuple[int, ...]) -> Ranges | None:
    """Slice and Split: the axis they cut (from the shapes torch's kernel gives) and each output's range (from a
    probe counting along that axis)."""
    if any(i not in layer.const_inputs for i in range(1, len(layer.input_shapes)) if layer.input_shapes[i]):
        return None   # slicing parameters computed at run time
    if layer.op_type == "Slice" and not _forward_unit_steps(layer, len(shape)):
        return None
    if layer.op_type == "Split" and layer.attrs.get("axis", 0) % len(shape) == 0:
        return None
    run = ReferenceTactic().prepare(layer)
    rest = [None] * (len(layer.input_shapes) - 1)
    try:
        outs = run([torch.empty(shape, device="meta"), *rest])
    except (RuntimeError, ValueError, IndexError, KeyError):
        return None
    cut = {k for o in outs for k in range(len(shape)) if o.dim() != len(shape) or o.shape[k] != shape[k]}
    if len(outs) != len(layer.output_dtypes) or any(o.dim() != len(shape) for o in outs) or len(cut) > 1 or 0 in cut:
        return None
    axis = cut.pop() if cut else len(shape) - 1
    probe = torch.arange(shape[axis], dtype=torch.float64).reshape([-1 if k == axis else 1 for k in range(len(shape))])
    moves = []
    for index, out in enumerate(run([probe, *rest])):
        values = out.reshape(-1)
        start = int(values[0]) if values.numel() else 0
        if not torch.equal(values, torch.arange(start, start + values.numel(), dtype=torch.float64)):
            return None   # not one contiguous forward range
        moves.append((index, 0, start, values.numel(), 0))
    return Ranges(axis, tuple(moves), (shape[axis],), tuple(o.shape[axis] for o in outs))


def _forward_unit_steps(layer: LayerView, rank: int) -> bool:
    """A Slice whose steps are all 1 and which leaves the batch axis alone (a full-length reversal elsewhere keeps
    the shape, and a batch cut depends on the batch)."""
    consts = layer.const_inputs
    steps = consts[4].reshape(-1).tolist() if 4 in consts else []
    starts = consts[1].reshape(-1).tolist() if 1 in consts else []
    axes = consts[3].reshape(-1).tolist() if 3 in consts else list(range(len(starts)))
    return all(s == 1 for s in steps) and all(a % rank != 0 for a in axes)


def copy_parts(ranges: Ranges, dims: tuple[int, ...], fmt: str, in_sizes: tuple[int, ...],
               tables: tuple[int | None, ...] | None = None) -> list[tuple[ctypes.Array, int, int]]:
    """Per output: (its CopyParts, the output's row length in elements, rows per batch item), for tensors shaped
    like `dims` (the first input's shape) in format `fmt`; `tables` the address of each input's byte table or
    None."""
    tables = tables or (None,) * len(in_sizes)
    order = MEMORY_ORDER[fmt] if fmt == HWC else tuple(range(len(dims)))
    at = order.index(ranges.axis)
    inner = math.prod(dims[k] for k in order[at + 1:])
    rows = math.prod(dims[k] for k in order[1:at])
    calls = []
    for o, extent in enumerate(ranges.out_extents):
        moves = [m for m in ranges.moves if m[0] == o]
        parts = (CopyPart * len(moves))(*(CopyPart(ranges.in_extents[i] * inner, start * inner, size * inner,
                                                   offset * inner, in_sizes[i], tables[i])
                                          for _, i, start, size, offset in moves))
        calls.append((parts, extent * inner, rows))
    return calls


def copied_dtype(dtype: str | None) -> torch.dtype:
    """The torch dtype a copy moves for a plan tensor's type: INT8 bytes as they are, floats as stored."""
    return INT8_TORCH.get(dtype) or storage_dtype(dtype)


class CopyRowsTactic:
    """FP32 or INT8 Concat, Slice and Split along an axis past the batch, in any layout their inputs come in (no
    conversion between INT8 and floats: every tensor of the layer one of them)."""

    name = COPY_TACTIC
    source = "kiln"
    needs_c_compiler = True
    outputs_as_planned = True   # a Concat of one-channel inputs is NCHW and NHWC at once: the plan's record decides
    stored_types = ("float32", "uint8", "int8")

    def supports(self, layer: LayerView) -> bool:
        if not copy_layer(layer) or not layer.output_dtypes:
            return False
        data = layer.input_dtypes if concatenates(layer) else layer.input_dtypes[:1]
        types = (*data, *layer.output_dtypes)
        if not all(d in self.stored_types for d in types) or len({d in INT8_TORCH for d in types}) > 1:
            return False
        tables = layer.attrs.get("in_tables") or [None] * len(data)
        if data[0] in INT8_TORCH and {t["dtype"] if t else d for d, t in zip(data, tables)} != set(layer.output_dtypes):
            return False   # bytes are copied as they are (or mapped to the output's type): u8 into s8 would be 128 off
        return layer_ranges(layer) is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        channel_major = HWC in input_formats[:len(layer.input_shapes) if concatenates(layer) else 1]
        return HWC if channel_major and len(layer.input_shapes[0]) == 4 else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        copy = native.library("reformat").kiln_copy_rows
        ranges = layer_ranges(layer)
        n_data = len(layer.input_shapes) if concatenates(layer) else 1
        in_types = [copied_dtype(d) for d in layer.input_dtypes[:n_data]]
        out_types = [(t, t.itemsize) for t in map(copied_dtype, layer.output_dtypes)]
        sizes = tuple(t.itemsize for t in in_types)
        layouts = LAYOUTS if len(layer.input_shapes[0]) == 4 else LAYOUTS[:1]
        tables = [None if t is None else table_bytes(t) for t in layer.attrs.get("in_tables") or [None] * n_data]
        addresses = tuple(None if t is None else t.data_ptr() for t in tables)
        calls = {fmt: copy_parts(ranges, layer.input_shapes[0], fmt, sizes, addresses) for fmt, _ in layouts}
        shapes = [tuple(ranges.out_extents[o] if k == ranges.axis else d for k, d in enumerate(layer.input_shapes[0]))
                  for o in range(len(out_types))]
        strides = {fmt: [torch.empty(s, device="meta", memory_format=mf).stride() for s in shapes]
                   for fmt, mf in layouts}   # the batch's stride does not depend on the batch

        def in_one_layout(xs):
            for fmt, memory_format in layouts:   # one-channel inputs are both: row-major out, made channel-major
                if all(x.is_contiguous(memory_format=memory_format) for x in xs):   # where the plan says (as_planned)
                    return fmt, xs
            fmt = HWC if HWC in calls and any(x.is_contiguous(memory_format=torch.channels_last) for x in xs) \
                else LINEAR
            return fmt, [to_format(x, fmt) for x in xs]

        consts = {fmt: {i: to_format(t.to(in_types[i]).contiguous(), fmt) for i, t in layer.const_inputs.items()
                        if i < n_data} for fmt, _ in layouts}   # a Concat's constant inputs (ViT's class token)

        def with_consts(xs):
            """The layer's inputs in one layout, constants included in it."""
            live = [x for i, x in enumerate(xs) if i not in consts[LINEAR]]
            fmt, live = in_one_layout(live) if live else (LINEAR, live)
            rest = iter(live)
            return fmt, [consts[fmt][i] if i in consts[fmt] else next(rest) for i in range(n_data)]

        tails = [tuple(s[1:]) for s in layer.input_shapes[:n_data]]   # the chunks assume them: checked per call

        def sources(xs):
            """The inputs' layout, their addresses (the caller keeps `xs` alive) and the batch."""
            fmt, xs = with_consts(xs[:n_data]) if consts[LINEAR] else in_one_layout(xs[:n_data])
            if any(x.dtype != t for x, t in zip(xs, in_types)):
                xs = [x.to(t) for x, t in zip(xs, in_types)]
            batch = xs[0].shape[0]
            if [x.shape[1:] for x in xs] != tails or any(x.shape[0] != batch for x in xs):
                raise ValueError(f"{self.name}: inputs shaped {[list(x.shape) for x in xs]}, the plan's are "
                                 f"{[['N', *t] for t in tails]}")
            return fmt, xs, (ctypes.c_void_p * n_data)(*[x.data_ptr() for x in xs]), batch

        def run(xs):
            fmt, xs, srcs, batch = sources(xs)
            outs = []
            for (parts, row, rows), shape, stride, (dtype, size) in zip(calls[fmt], shapes, strides[fmt], out_types):
                y = torch.empty_strided((batch, *shape[1:]), stride, dtype=dtype)
                copy(parts, len(parts), srcs, y.data_ptr(), row, size, batch * rows, row)
                outs.append(y)
            return outs

        def write_into(xs, out):
            """The one output straight into `out`, where it is this layout with wider rows (a Concat's slice)."""
            fmt, xs, srcs, batch = sources(xs)
            (parts, row, rows), (dtype, size) = calls[fmt][0], out_types[0]
            order = MEMORY_ORDER[fmt] if fmt == HWC else tuple(range(len(shapes[0])))
            fits = out.dtype == dtype and tuple(out.shape) == (batch, *shapes[0][1:])
            step = row_step(out, order, order.index(ranges.axis)) if fits else None
            if step is None:
                out.copy_(run(xs)[0])
                return
            copy(parts, len(parts), srcs, out.data_ptr(), step, size, batch * rows, row)
        run.tables = tables   # the parts hold their addresses
        if len(out_types) == 1:
            run.write_into = write_into
        return run


class CopyRowsBf16Tactic(Bf16Storage, CopyRowsTactic):
    """Granted BF16: tensors as the plan stores them, each input FP32 or bf16 and each output in the type its
    readers take, converted as they are copied (exact, bar the rounding of an FP32 input to a bf16 output)."""

    name = COPY_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset(range(MOVED_INPUTS))
    writes_every_output = True
