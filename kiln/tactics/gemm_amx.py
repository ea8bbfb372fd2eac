"""kiln's BF16 GEMM and direct convolution on AMX tiles (kiln/native/csrc/gemm_amx.h): the same layers, storage
types and fused epilogue as kiln.tactics.gemm_bf16's `vdpbf16ps` kernels, with the products on the AMX-BF16
matrix unit (`tdpbf16ps`, 16 x 16 FP32 accumulators over 16 x 32 bf16 operand tiles). A block of 32 rows is
packed once as bf16 and multiplied by every weight panel; the weights are packed at load with each k range
padded to whole 32-value tile steps.

Offered only where the CPU reports AMX-BF16, Linux grants the process AMX state, and a self-check GEMM agrees
with the AVX512-BF16 kernel (`amx_usable`), run in a child process with its verdict cached (kiln.native.selfcheck).
A loaded engine whose CPU lacks any of these runs the layer on the AVX512-BF16 sibling (`fallback_tactic`) with
one warning. The autotuner times both, and oneDNN's, per layer.
Tested on CPUs without AMX through gemm.c compiled with -DKILN_AMX_EMULATE (amx.h's tile operations in C)."""
from __future__ import annotations

import functools
import logging

import torch

from kiln import hardware, native
from kiln.native import selfcheck
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_bf16 import (
    BF16_DOT_ISA, Conv1x1GemmBf16Tactic, DirectConvBf16Tactic, MatMulGemmBf16Tactic, pack_bf16_pairs,
    pack_bf16_segments,
)

log = logging.getLogger("kiln.tactics")
AMX_ISA = ("amx_bf16",)
TILE_BYTES = native.header_constant("amx.h", "AMX_TILE_BYTES")   # one tile row: one k step of the AMX kernels

# The vdpbf16ps kernels' packing with every k range (a kernel row's segment for a convolution) padded to whole
# tile steps: [n/32][kq][32] bf16 pairs, a tile row being TILE_BYTES / 4 pairs.
pack_amx_pairs = functools.partial(pack_bf16_pairs, k_multiple=TILE_BYTES // 2)
pack_amx_segments = functools.partial(pack_bf16_segments, k_multiple=TILE_BYTES // 2)


def amx_offered(kind: str, isas: tuple[tuple[str, ...], ...], library: str, ready: str, module: str) -> bool:
    """Whether kiln's AMX `kind` kernels may be offered: every one of `isas` here (each any of its names), Linux
    granting this process AMX state (`library`'s `ready` function), and their self-check passing in a child
    process (`python -m module`, kiln.native.selfcheck); a warning names whichever failed."""
    if not all(hardware.has_any(isa) for isa in isas) or not native.available():
        return False
    if not getattr(native.library(library), ready)():
        log.warning("this CPU has AMX-%s but Linux did not grant this process AMX state (arch_prctl "
                    "ARCH_REQ_XCOMP_PERM failed): kiln's AMX %s kernels are not offered", kind, kind)
        return False
    verdict = selfcheck.verdict(library, module)
    if not verdict.passed:
        log.warning("kiln's AMX %s kernels failed their self-check (%s): they are not offered", kind, verdict.detail)
    return verdict.passed


def child_check(library: str, ready: str, check) -> tuple[bool, str]:
    """A self-check as its child process runs it: AMX state requested for this process, then `check()`."""
    if not getattr(native.library(library), ready)():
        return False, "Linux did not grant the self-check process AMX state"
    return check()


@functools.lru_cache(maxsize=None)
def amx_usable() -> bool:
    """AMX-BF16 here, granted to this process, and agreeing with the AVX512-BF16 kernel on a self-check GEMM."""
    return amx_offered("BF16", (AMX_ISA, BF16_DOT_ISA), "gemm", "kiln_amx_ready", "kiln.tactics.gemm_amx")


def self_check() -> tuple[bool, str]:
    """The self-check as kiln.native.selfcheck runs it, in a child process (a fault there costs only the AMX
    tactics): `self_check_error` within 1e-4."""
    def within() -> tuple[bool, str]:
        error = self_check_error()
        return error <= 1e-4, f"max relative difference {error:.3g} from the AVX512-BF16 GEMM (at most 1e-4 passes)"
    return child_check("gemm", "kiln_amx_ready", within)


def self_check_error() -> float:
    """Max difference, relative to the largest value, between the AMX and AVX512-BF16 kernels of a 45 x 70 x 75
    MatMul with bias and ReLU (a partial row block, k step and panel). The AMX kernel is prepared through its
    base class, past the usability check this result feeds."""
    gen = torch.Generator().manual_seed(0)
    w, bias, x = torch.randn(70, 75, generator=gen), torch.randn(75, generator=gen), torch.randn(45, 70, generator=gen)
    view = LayerView("MatMul", "", {"activation": {"op": "Relu", "attrs": {}}}, ((45, 70), (70, 75), (75,)),
                     ("float32",) * 3, {1: w, 2: bias}, ("float32",), 17, ((), (), ()))
    amx = MatMulGemmBf16Tactic.prepare(MatMulGemmAmxTactic(), view)([x, None, None])[0]
    want = MatMulGemmBf16Tactic().prepare(view)([x, None, None])[0]
    return float((amx - want).abs().max() / want.abs().max().clamp_min(1e-30))


class AmxVariant:
    """Mixin over one of kiln's C tactics: its AMX entry point and packing, offered where `usable()` (AMX there,
    granted, self-checked); `fallback_tactic` (the AVX-512 sibling) runs the layer where a loading CPU cannot."""

    def supports(self, layer) -> bool:
        return super().supports(layer) and self.usable()

    def prepare(self, layer):
        if not self.usable():
            log.warning("%s: AMX is not usable here; its layers run on %s", self.name, self.fallback_tactic.name)
            return self.fallback_tactic.prepare(layer)
        return super().prepare(layer)


class AmxGemm(AmxVariant):
    required_isa = AMX_ISA
    usable = staticmethod(lambda: amx_usable())   # looked up per call, so tests can stand in emulated AMX


class Conv1x1GemmAmxTactic(AmxGemm, Conv1x1GemmBf16Tactic):
    name = "kiln.conv2d_1x1_gemm_nhwc_amx_bf16"
    entry_point = "kiln_gemm_bf16_amx"
    pack = staticmethod(pack_amx_pairs)
    fallback_tactic = Conv1x1GemmBf16Tactic()


class MatMulGemmAmxTactic(AmxGemm, MatMulGemmBf16Tactic):
    name = "kiln.matmul_gemm_amx_bf16"
    entry_point = "kiln_gemm_bf16_amx"
    pack = staticmethod(pack_amx_pairs)
    fallback_tactic = MatMulGemmBf16Tactic()


class DirectConvAmxTactic(AmxGemm, DirectConvBf16Tactic):
    name = "kiln.conv2d_direct_gemm_nhwc_amx_bf16"
    entry_point = "kiln_conv_bf16_amx"
    pack = staticmethod(pack_amx_segments)
    fallback_tactic = DirectConvBf16Tactic()


if __name__ == "__main__":   # the self-check's child process (kiln.native.selfcheck)
    selfcheck.report(*self_check())
