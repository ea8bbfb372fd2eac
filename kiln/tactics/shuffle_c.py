"""kiln's Shuffle layers (reshape and transpose steps) as at most one copy, in C (reformat.c's `kiln_permute`).

A Shuffle's steps compose into one permutation of a finer view of its input: every reshape only groups or splits
axes, so the input's axes are cut into the factors the steps move as units ("atoms"), the steps permute those, and
the output is one copy of the input viewed as its atoms, permuted, then reshaped. MobileViT's unfold of
[1, 144, 32, 32] into 2x2 patches (reshape, transpose, reshape, transpose, reshape) was two strided torch copies,
0.54 ms; one torch copy of the composed permutation takes 0.22 ms, `kiln_permute` (register-transposed tiles of the
two innermost axes) less. Steps that compose to the identity only reshape: the output is a view, no copy. An input
in channel-major layout (NHWC, a convolution's output) is read as it lies, the layout being one more transpose:
ConvNeXt's NCHW -> NHWC Transpose after a channel-major convolution is then a view, no Reformat before it.

Plans are composed per input shape and layout, the first time each is seen (a dynamic axis's sizes vary)."""
from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import torch

from kiln import native
from kiln.ops.dtypes import NUMPY_TO_TORCH
from kiln.ops.fused import apply_steps
from kiln.tactics.base import ANY, HWC, LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, stored_channel_major

PERMUTE_TACTIC = "kiln.permute_copy"
MAX_RANK = 8   # reformat.c's PERMUTE_MAX_RANK
SHORT_ROWS = 8   # an output innermost axis shorter than this, and not the input's, is left to torch (_scattered)
TO_LOGICAL_NCHW = {"transpose": [0, 3, 1, 2]}   # a channels-last [N, C, H, W] read as the [N, H, W, C] it stores
TORCH_TYPES = {str(n): t for n, t in NUMPY_TO_TORCH.items()}   # plan type names ("int64", "bfloat16", ...)


@dataclass(frozen=True)
class Permutation:
    """The input viewed as `dims` (row-major), output axis i being input axis `perm[i]`, then shaped `out_shape`;
    an empty `perm`: the output is a view (the steps only reshape)."""

    dims: tuple[int, ...]
    perm: tuple[int, ...]
    out_shape: tuple[int, ...]


def compose(shape: tuple[int, ...], steps: list[dict]) -> Permutation | None:
    """The steps applied to a row-major tensor of `shape` as one Permutation, merged (no size-1 axes, no two input
    axes that stay neighbours); None where a step slices or a reshape cuts across what a transpose moved."""
    sizes: list[int] = []                        # atom id -> size
    def atom(size: int) -> int:
        sizes.append(size)
        return len(sizes) - 1
    source = [atom(d) for d in shape]            # the input's atoms, in memory order
    axes = [[a] for a in source]                 # the current tensor: per axis, its atoms outermost first
    for step in steps:
        if "transpose" in step:
            perm = step["transpose"]
            if sorted(perm) != list(range(len(axes))):
                return None
            axes = [axes[p] for p in perm]
        elif "reshape" in step:
            current = [math.prod(sizes[a] for a in ax) for ax in axes]
            target = _resolved(step["reshape"], current)
            if target is None:
                return None
            axes = _regroup([a for ax in axes for a in ax], target, sizes, source, atom)
            if axes is None:
                return None
        else:
            return None   # slices: the reference kernel's
    order = [a for ax in axes for a in ax]
    out_shape = tuple(math.prod(sizes[a] for a in ax) for ax in axes)
    return _merged(source, order, sizes, out_shape)


def _resolved(target: list[int], current: list[int]) -> list[int] | None:
    """A reshape target with 0 (copy that axis) and one -1 (inferred) written out."""
    dims = [current[i] if d == 0 and i < len(current) else d for i, d in enumerate(target)]
    known, total = math.prod(d for d in dims if d != -1), math.prod(current)
    if dims.count(-1) > 1 or (dims.count(-1) == 1 and (known == 0 or total % known)):
        return None
    dims = [total // known if d == -1 else d for d in dims]
    return dims if math.prod(dims) == total else None


def _regroup(seq: list[int], target: list[int], sizes: list[int], source: list[int], atom) -> list[list[int]] | None:
    """Atoms in memory order grouped into the target's axes, an atom split (everywhere: in `source` too) where an
    axis boundary falls inside it; None where a boundary cannot fall on a factor."""
    seq = [a for a in seq if sizes[a] != 1]
    groups, i = [], 0
    for dim in target:
        group, product = [], 1
        while product < dim and i < len(seq):
            a = seq[i]
            if product * sizes[a] <= dim:
                group.append(a)
                product *= sizes[a]
                i += 1
                continue
            outer = dim // product
            if dim % product or sizes[a] % outer:
                return None
            hi, lo = atom(outer), atom(sizes[a] // outer)   # the atom's outer factor closes this axis
            at = source.index(a)
            source[at:at + 1] = [hi, lo]
            seq[i:i + 1] = [hi, lo]
        if product != dim:
            return None
        groups.append(group)
    return groups if i == len(seq) else None


def _merged(source: list[int], order: list[int], sizes: list[int], out_shape: tuple[int, ...]) -> Permutation:
    source = [a for a in source if sizes[a] != 1]
    order = [a for a in order if sizes[a] != 1]
    runs: list[list[int]] = []                   # output atoms that are input neighbours, in order: one axis each
    for a in order:
        if runs and source.index(a) == source.index(runs[-1][-1]) + 1:
            runs[-1].append(a)
        else:
            runs.append([a])
    in_order = sorted(runs, key=lambda run: source.index(run[0]))
    dims = tuple(math.prod(sizes[a] for a in run) for run in in_order)
    perm = tuple(in_order.index(run) for run in runs)
    return Permutation(dims, () if perm == tuple(range(len(perm))) else perm, out_shape)


def _channel_major_view(stored: tuple[int, ...], channels_last: bool, steps: list[dict]) -> tuple[int, ...] | None:
    """The output's NHWC shape where the output (4-D, not itself a row-major view) is the input's bytes in
    channel-major order; None elsewhere."""
    read = [TO_LOGICAL_NCHW] if channels_last else []
    plain = compose(stored, read + steps)
    if plain is None or not plain.perm or len(plain.out_shape) != 4:
        return None
    nhwc = compose(stored, read + steps + [{"transpose": [0, 2, 3, 1]}])
    return nhwc.out_shape if nhwc is not None and not nhwc.perm else None


def _scattered(p: Permutation) -> bool:
    """The output's innermost axis is short and not the input's: each tile writes a few elements per line
    (MobileViT's fold back into 2x2 patches: 2 floats), slower than torch's strided copy, which keeps the layer."""
    return bool(p.perm) and p.perm[-1] != len(p.dims) - 1 and p.dims[p.perm[-1]] < SHORT_ROWS


class PermuteCopyTactic:
    """Shuffles of reshape and transpose steps, any element type of 1, 2, 4 or 8 bytes (FP32, INT8 bytes, int64
    shapes), input in either layout, output row-major."""

    name = PERMUTE_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Shuffle" or layer.domain != "kiln" or len(layer.output_dtypes) != 1:
            return False
        shape, dtype = layer.input_shapes[0], layer.input_dtypes[0]
        if shape is None or not self._types_fit(dtype, layer.output_dtypes[0]):
            return False
        plan = compose(tuple(shape), layer.attrs.get("steps", []))
        return plan is not None and len(plan.dims) <= MAX_RANK and not _scattered(plan) and native.available()

    @staticmethod
    def _types_fit(dtype: str | None, out: str) -> bool:
        return dtype == out and dtype in TORCH_TYPES and TORCH_TYPES[dtype].itemsize in (1, 2, 4, 8)

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY] + [LINEAR] * (len(layer.input_shapes) - 1)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        """Channel-major where the output is then a view of the input's bytes (ConvNeXt's NHWC -> NCHW Transpose
        before a convolution: no copy and no Reformat), else row-major. Static shapes only: whether a view is one
        can turn on a dynamic axis being 1, and the layout must hold at every size."""
        shape, steps = tuple(layer.input_shapes[0]), layer.attrs.get("steps", [])
        if any(layer.input_dynamic):
            return LINEAR
        channels_last = input_formats[0] == HWC and len(shape) == 4
        stored = (shape[0], *shape[2:], shape[1]) if channels_last else shape
        return HWC if _channel_major_view(stored, channels_last, steps) is not None else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        permute = native.library("reformat").kiln_permute
        steps, out_type = list(layer.attrs.get("steps", [])), TORCH_TYPES[layer.output_dtypes[0]]
        static = not any(layer.input_dynamic)   # channel-major views only then (output_format)
        plans: dict[tuple, tuple | None] = {}
        lock = threading.Lock()

        def plan_for(key, shape, channels_last):
            with lock:
                if key not in plans:
                    p = compose(shape, [TO_LOGICAL_NCHW] + steps if channels_last else steps)
                    arrays = None if p is None or not p.perm else \
                        ((ctypes.c_int64 * len(p.dims))(*p.dims), (ctypes.c_int64 * len(p.perm))(*p.perm))
                    view = _channel_major_view(shape, channels_last, steps) if static else None
                    plans[key] = None if p is None or len(p.dims) > MAX_RANK else (p, arrays, view)
                return plans[key]

        def run(xs):
            x = xs[0] if xs[0].dtype == out_type else xs[0].to(out_type)
            channels_last = stored_channel_major(x)
            base = x.permute(0, 2, 3, 1) if channels_last else x.contiguous()
            key = (tuple(base.shape), channels_last)
            found = plans[key] if key in plans else plan_for(key, tuple(base.shape), channels_last)
            if found is None:
                return [apply_steps(x, steps).contiguous()]
            p, arrays, view = found
            if view is not None:   # channel-major, as output_format says
                return [base.reshape(view).permute(0, 3, 1, 2)]
            if arrays is None:
                return [base.reshape(p.out_shape)]
            y = torch.empty(p.out_shape, dtype=out_type)
            permute(base.data_ptr(), y.data_ptr(), len(p.dims), arrays[0], arrays[1], base.element_size())
            return [y]
        return run


class PermuteCopyBf16Tactic(Bf16Storage, PermuteCopyTactic):
    """Granted BF16: the input as the plan stores it (FP32 or bf16), the output in the type its readers take,
    converted before the copy where the two differ."""

    name = PERMUTE_TACTIC + "_bf16"
    bf16_inputs = frozenset({0})

    @staticmethod
    def _types_fit(dtype: str | None, out: str) -> bool:
        return dtype in STORED_FLOATS and out in STORED_FLOATS
