"""kiln's INT8 GEMM and direct convolution on AMX tiles (kiln/native/csrc/qgemm_amx.h, `tdpbusd`: 16 x 16 int32
accumulators over 16 x 64 u8 and 16 x 16 x 4 s8 operand tiles): the same layers, semantics and epilogue as
kiln.tactics.qgemm_c's VNNI kernels (zero-point compensation, per-channel scales, bias, INT8 or FP32
residual, activation, FP32 or requantized u8/s8 out). A block of 32 rows is packed once and multiplied by every weight
panel; the weights are packed at load with each k range padded to whole 64-byte tile steps.

Offered where the CPU reports AMX-INT8, Linux grants the process AMX state, and a self-check gives exactly the
VNNI kernel's bytes (integer sums, the same epilogue), run in a child process with its verdict cached
(kiln.native.selfcheck). Loaded where that fails, the layer runs on the VNNI
sibling with one warning. Tested on CPUs without AMX through qgemm.c compiled with -DKILN_AMX_EMULATE."""
from __future__ import annotations

import functools

import torch

from kiln.native import selfcheck
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_amx import TILE_BYTES, AmxVariant, amx_offered, child_check
from kiln.tactics.qgemm_c import (
    QConvDirectTactic, QConvGemmTactic, QLinearGemmTactic, pack_quads, pack_segments,
)

AMX_INT8_ISA = ("amx_int8",)
# The VNNI kernels' packing with every k range (a kernel row's segment for a convolution) padded to whole
# 64-byte tile steps: [n/32][kq][32][4] s8.
pack_amx_quads = functools.partial(pack_quads, k_multiple=TILE_BYTES)
pack_amx_segments = functools.partial(pack_segments, k_multiple=TILE_BYTES)


def self_check_view() -> tuple[LayerView, torch.Tensor]:
    """A 45-row u8 x s8 [70 x 75] QMatMul with per-channel scales and zero points, bias and ReLU, u8 out; and its
    input."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (70, 75), generator=gen, dtype=torch.int8)
    quant = {"x_scale": 0.02, "x_zero_point": 3, "x_dtype": "uint8", "w_scale": [0.003 + 1e-5 * i for i in range(75)],
             "w_zero_point": [i % 7 - 3 for i in range(75)], "w_axis": 1, "y_scale": 0.05, "y_zero_point": 5, "y_dtype": "uint8"}
    view = LayerView("QMatMul", "kiln", {"quant": quant, "activation": {"op": "Relu", "attrs": {}}},
                     ((45, 70), (70, 75)), ("uint8", "int8"), {1: w}, ("uint8",), 17, ((), ()))
    return view, torch.randint(0, 256, (45, 70), generator=gen, dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def amx_int8_usable() -> bool:
    """AMX-INT8 here, granted to this process, and giving the VNNI kernel's exact bytes on a self-check."""
    return amx_offered("INT8", (AMX_INT8_ISA, ("avx512_vnni",)), "qgemm", "kiln_amx_int8_ready",
                       "kiln.tactics.qgemm_amx")


def self_check() -> tuple[bool, str]:
    """The self-check as kiln.native.selfcheck runs it, in a child process: `self_check_passes`."""
    def exact() -> tuple[bool, str]:
        passed = self_check_passes()
        return passed, "the VNNI GEMM's bytes exactly" if passed else "its bytes differ from the VNNI GEMM's"
    return child_check("qgemm", "kiln_amx_int8_ready", exact)


def self_check_passes() -> bool:
    """The AMX kernel (prepared through its base class, past the usability check this result feeds) gives the
    VNNI kernel's bytes."""
    view, x = self_check_view()
    amx = QLinearGemmTactic.prepare(QLinearGemmAmxTactic(), view)([x, None])[0]
    return torch.equal(amx, QLinearGemmTactic().prepare(view)([x, None])[0])


class AmxInt8(AmxVariant):
    required_isa = AMX_INT8_ISA
    usable = staticmethod(lambda: amx_int8_usable())   # looked up per call, so tests can stand in emulated AMX


class QConvGemmAmxTactic(AmxInt8, QConvGemmTactic):
    name = "kiln.qconv2d_1x1_gemm_nhwc_amx_int8"
    entry_point = "kiln_qgemm_amx"
    pack = staticmethod(pack_amx_quads)
    fallback_tactic = QConvGemmTactic()


class QConvDirectAmxTactic(AmxInt8, QConvDirectTactic):
    name = "kiln.qconv2d_direct_nhwc_amx_int8"
    entry_point = "kiln_qconv_amx"
    pack = staticmethod(pack_amx_segments)
    fallback_tactic = QConvDirectTactic()


class QLinearGemmAmxTactic(AmxInt8, QLinearGemmTactic):
    name = "kiln.qmatmul_gemm_amx_int8"
    entry_point = "kiln_qgemm_amx"
    pack = staticmethod(pack_amx_quads)
    fallback_tactic = QLinearGemmTactic()


if __name__ == "__main__":   # the self-check's child process (kiln.native.selfcheck)
    selfcheck.report(*self_check())
