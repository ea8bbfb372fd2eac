"""Output views: a kernel asked to write into a slice of a larger tensor (a Concat's output, kiln.runtime.elision)
writes its own layout directly when the slice is that layout with wider rows, and through a copy otherwise."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Compute = Callable[[list], list]


def row_step(view: torch.Tensor, order: Sequence[int], at: int) -> int | None:
    """The element distance between consecutive rows of `view`, where a row is its axes order[at:] (memory order,
    outermost first) stored contiguously and the outer axes order[:at] step over whole rows; None where the view is
    not laid out so. A contiguous tensor's row step is its row length; a channel slice of a wider channel-major
    tensor's is the wider tensor's channel count."""
    shape, strides = view.shape, view.stride()
    expected = 1
    for k in reversed(order[at:]):
        if shape[k] > 1 and strides[k] != expected:
            return None
        expected *= shape[k]
    row, step, below = expected, None, 1   # below: rows per step of the outer axis being checked
    for k in reversed(order[:at]):
        if shape[k] > 1:
            if step is None:
                if strides[k] % below:
                    return None
                step = strides[k] // below
            if strides[k] != step * below:
                return None
        below *= shape[k]
    step = row if step is None else step
    return step if step >= row else None


def copy_into(compute: Compute) -> Callable[[list, torch.Tensor], None]:
    """`write_into` for a kernel that only allocates its output: compute, then copy into the view."""
    def write_into(xs: list, out: torch.Tensor) -> None:
        out.copy_(compute(xs)[0])
    return write_into


def rows_of(view: torch.Tensor, order: Sequence[int], at: int) -> int:
    """How many rows (runs of axes order[at:]) the view holds."""
    return math.prod(view.shape[k] for k in order[:at])
