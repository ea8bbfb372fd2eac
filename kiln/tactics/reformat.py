"""Reformat kernels: copy a tensor between row-major (NCHW) and channel-major (NHWC) layouts."""
from __future__ import annotations

import torch

from kiln.tactics.base import HWC, Kernel

REFORMAT_TACTIC = "kiln.reformat_copy"
NOOP_TACTIC = "kiln.noop"


def prepare_reformat(target_format: str) -> Kernel:
    if target_format == HWC:
        return lambda xs: [xs[0].contiguous(memory_format=torch.channels_last)]
    return lambda xs: [xs[0].contiguous()]


def is_noop_reformat(shape: tuple[int, ...]) -> bool:
    """NCHW and NHWC coincide in memory when H*W == 1 or C == 1 (TensorRT reports these as NoOp)."""
    return len(shape) == 4 and (shape[2] * shape[3] == 1 or shape[1] == 1)
