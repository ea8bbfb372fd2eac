"""Output views: a kernel asked to write into a slice of a larger tensor (a Concat's output, kiln.runtime.elision)
writes its own layout directly when the slice is that layout with wider rows, and through a copy otherwise."""
from __future__ import annotations

from collections.abc import Sequence

import torch


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

