"""Reformat kernels: copy a tensor between row-major (NCHW) and channel-major (NHWC) layouts.

FP32 and bf16 4-D copies run a register-blocked transpose in C (kiln/native/csrc/reformat.c; bf16 YOLOv8n head,
144 x 80 x 80 into NCHW: 0.05 against torch's 0.28 ms); torch's permuting copy is
2-15x slower either way (2 threads, Zen 4: into NHWC 48 x 160 x 160 0.11 against 1.74 ms, 256 x 56 x 56 0.06 against
0.39; back into NCHW 144 x 80 x 80, YOLOv8n's detect head, 0.09 against 0.40; 256 x 56 x 56 0.06 against 0.77)."""
from __future__ import annotations

import torch

from kiln import native
from kiln.tactics.base import HWC, Kernel

REFORMAT_TACTIC = "kiln.reformat_copy"
IO_BITS = {torch.float32: 0, torch.bfloat16: 3}   # reformat.c's `io`: source and destination bf16
NOOP_TACTIC = "kiln.noop"


def to_format(x: torch.Tensor, target_format: str) -> torch.Tensor:
    """`x` in `target_format` (HWC: channels-last); no copy when it already is."""
    last = torch.channels_last
    if x.is_contiguous(memory_format=last) if target_format == HWC else x.is_contiguous():
        return x
    lib = native.library("reformat") if x.dim() == 4 and x.dtype in IO_BITS else None
    n, c = (x.shape[0], x.shape[1]) if x.dim() == 4 else (0, 0)
    if lib is not None and target_format == HWC and x.is_contiguous():
        y = torch.empty(x.shape, dtype=x.dtype, memory_format=last)
        lib.kiln_to_nhwc(x.data_ptr(), y.data_ptr(), n, c, x.shape[2] * x.shape[3], IO_BITS[x.dtype])
        return y
    if lib is not None and target_format != HWC and x.is_contiguous(memory_format=last):
        y = torch.empty(x.shape, dtype=x.dtype)
        lib.kiln_to_nchw(x.data_ptr(), y.data_ptr(), n, c, x.shape[2] * x.shape[3], IO_BITS[x.dtype])
        return y
    return x.contiguous(memory_format=last) if target_format == HWC else x.contiguous()


def prepare_reformat(target_format: str) -> Kernel:
    return lambda xs: [to_format(xs[0], target_format)]


def is_noop_reformat(shape: tuple[int, ...]) -> bool:
    """NCHW and NHWC coincide in memory when H*W == 1 or C == 1 (TensorRT reports these as NoOp)."""
    return len(shape) == 4 and (shape[2] * shape[3] == 1 or shape[1] == 1)
