"""kiln's BF16 GEMM and direct convolution on AMX tiles (kiln/native/csrc/gemm_amx.h): the same layers, storage
types and fused epilogue as kiln.tactics.gemm_bf16's `vdpbf16ps` kernels, with the products on the AMX-BF16
matrix unit (`tdpbf16ps`, 16 x 16 FP32 accumulators over 16 x 32 bf16 operand tiles). A block of 32 rows is
packed once as bf16 and multiplied by every weight panel; the weights are packed at load with each k range
padded to whole 32-value tile steps.

Offered only where the CPU reports AMX-BF16, Linux grants the process AMX state, and a self-check GEMM agrees
with the AVX512-BF16 kernel (`amx_usable`). A loaded engine whose CPU lacks any of these runs the layer on the
AVX512-BF16 sibling (`fallback_tactic`) with one warning. The autotuner times both, and oneDNN's, per layer.
Tested on CPUs without AMX through gemm.c compiled with -DKILN_AMX_EMULATE (amx.h's tile operations in C)."""
from __future__ import annotations

import functools
import logging

import torch

from kiln import hardware, native
from kiln.tactics.gemm_bf16 import (
    Conv1x1GemmBf16Tactic, DirectConvBf16Tactic, MatMulGemmBf16Tactic, pack_bf16_pairs,
)

log = logging.getLogger("kiln.tactics")
AMX_ISA = ("amx_bf16",)
STEP_PAIRS = native.header_constant("amx.h", "AMX_TILE_BYTES") // 4   # bf16 pairs per tile row: one k step


def whole_steps(values: int) -> int:
    """`values` bf16 values padded to whole tile steps, counted in values."""
    pairs = -(-values // 2)
    return -(-pairs // STEP_PAIRS) * STEP_PAIRS * 2


def pack_amx_pairs(b: torch.Tensor) -> torch.Tensor:
    """[k, n] FP32 -> int32 [panels, kq, 32] as pack_bf16_pairs, k zero-padded to whole tile steps."""
    k, n = b.shape
    padded = torch.zeros((whole_steps(k), n), dtype=torch.float32)
    padded[:k] = b
    return pack_bf16_pairs(padded)


def pack_amx_segments(weight: torch.Tensor) -> torch.Tensor:
    """[kh, kw * c, cout] -> [cout/32][kh * segment steps][32]: each kernel row's segment padded to whole steps."""
    kh, seg, cout = weight.shape
    padded = torch.zeros((kh, whole_steps(seg), cout), dtype=torch.float32)
    padded[:, :seg] = weight
    return pack_bf16_pairs(padded.reshape(-1, cout))


@functools.lru_cache(maxsize=None)
def amx_usable() -> bool:
    """AMX-BF16 here, granted to this process, and agreeing with the AVX512-BF16 kernel on a self-check GEMM."""
    if not hardware.has_any(AMX_ISA) or not hardware.has_any(("avx512_bf16",)) or not native.available():
        return False
    lib = native.library("gemm")
    if not lib.kiln_amx_ready():
        log.warning("this CPU has AMX-BF16 but Linux did not grant this process AMX state (arch_prctl "
                    "ARCH_REQ_XCOMP_PERM failed): kiln's AMX kernels are not offered")
        return False
    error = self_check_error(lib)
    if error > 1e-4:
        log.warning("kiln's AMX BF16 GEMM disagrees with its AVX512-BF16 GEMM on a self-check (max relative "
                    "difference %.3g): the AMX kernels are not offered", error)
        return False
    return True


def self_check_error(lib) -> float:
    """Max difference, relative to the largest value, between the AMX and AVX512-BF16 GEMMs on a 45 x 70 x 75
    product with bias and ReLU (partial row block, k step and panel)."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 45, 70, 75
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    bias = torch.zeros(-(-n // 32) * 32)
    bias[:n] = torch.randn(n, generator=gen)
    outs = []
    for entry, packed in ((lib.kiln_gemm_bf16_amx, pack_amx_pairs(b)), (lib.kiln_gemm_bf16, pack_bf16_pairs(b))):
        out = torch.empty(m, n)
        entry(a.data_ptr(), 0, m, k, 0, packed.data_ptr(), 0, out.data_ptr(), 0, bias.data_ptr(), None, 1, 1, m, k,
              n, 0)
        outs.append(out)
    return float((outs[0] - outs[1]).abs().max() / outs[1].abs().max().clamp_min(1e-30))


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
