"""kiln's own BF16 GEMM (kiln/native/csrc/gemm.c, `kiln_gemm_bf16`): the FP32 GEMM's tiles and epilogue with
bf16 operands and FP32 accumulation on AVX512-BF16's `vdpbf16ps`, for convolutions (1x1 as a GEMM, others
direct, window rows read in place) and linear layers under `--bf16`. The weights are rounded to bf16 once at load.
The input, the output and the fused residual are each FP32 or bf16, as the plan stores them (kiln.tactics.storage):
an FP32 input's rows are rounded as each tile starts, a bf16 one's read in place; the output is written with
bias, residual and the activation applied in FP32, rounded to bf16 where it is stored so.

Why kiln has its own beside oneDNN's: a oneDNN call through torch costs ~50 µs of descriptor work and casts
(benchmarks/overhead.py), kiln's ~6 µs, and at BF16 speeds a ResNet-50 layer often computes in less than that.
The autotuner times both; each wins where it is faster."""
from __future__ import annotations

import torch

from kiln import hardware, native
from kiln.tactics import gemm_c
from kiln.tactics.conv1x1 import Conv1x1GemmTactic
from kiln.tactics.conv_direct import DirectConv1dTactic, DirectConvTactic
from kiln.tactics.matmul_c import MatMulGemmTactic

BF16_DOT_ISA = ("avx512_bf16",)


def pack_bf16_pairs(b: torch.Tensor, k_multiple: int = 2) -> torch.Tensor:
    """[k, n] FP32 -> int32 [panels, k/2, 32]: each 32-bit lane holds rows 2q (low half) and 2q+1 (high half) of
    one column in bf16, rounded to nearest even; k padded to a multiple of `k_multiple` (even) and the columns to
    whole panels with zeros."""
    k, n = b.shape
    panels, pairs = -(-n // gemm_c.PANEL), -(-k // k_multiple) * k_multiple // 2
    padded = torch.zeros((pairs * 2, panels * gemm_c.PANEL), dtype=torch.float32)
    padded[:k, :n] = b
    lanes = padded.view(pairs, 2, panels, gemm_c.PANEL).permute(2, 0, 3, 1)   # [panels, pairs, 32, 2]
    return lanes.to(torch.bfloat16).contiguous().view(torch.int32).reshape(panels, pairs, gemm_c.PANEL)


def pack_bf16_segments(weight: torch.Tensor, k_multiple: int = 2) -> torch.Tensor:
    """[kh, kw * c, cout] -> kiln_conv_bf16's panels: each kernel row's segment padded to a multiple of
    `k_multiple` (even), so no bf16 pair straddles two rows, [cout/32][kh * segment pairs][32]."""
    kh, seg, cout = weight.shape
    padded = torch.zeros((kh, -(-seg // k_multiple) * k_multiple, cout), dtype=torch.float32)
    padded[:, :seg] = weight
    return pack_bf16_pairs(padded.reshape(-1, cout))


# gemm.h's `io` bits (one definition, read from the header): which of the input, the output and the residual are
# stored in bf16
IO_A_BF16, IO_C_BF16, IO_RES_BF16 = (native.header_constant("gemm.h", name)
                                     for name in ("IO_A_BF16", "IO_C_BF16", "IO_RES_BF16"))


def io_flags(layer) -> int:
    """The `io` field of kiln_gemm_bf16's and kiln_conv_bf16's call structure, from the dtypes the plan stores the
    layer's tensors in."""
    bf16 = "bfloat16"
    residual = len(layer.input_dtypes) > 3 and layer.input_dtypes[3] == bf16
    return ((IO_A_BF16 if layer.input_dtypes[0] == bf16 else 0) | (IO_C_BF16 if layer.output_dtypes[0] == bf16 else 0)
            | (IO_RES_BF16 if residual else 0))


class Bf16Gemm:
    """Mixin: the same tactic on kiln_gemm_bf16, offered where the CPU has AVX512-BF16 (a loaded engine's kernel
    falls back to the reference kernel where it is missing: `required_isa`). Reads its input (0) and residual (3)
    and writes its output in bf16 where the plan stores them so."""

    reduced_precisions = frozenset({"BF16"})
    required_isa = BF16_DOT_ISA
    entry_point = "kiln_gemm_bf16"
    pack = staticmethod(pack_bf16_pairs)
    io_flags = staticmethod(io_flags)
    bf16_inputs = frozenset({0, 3})
    writes_bf16 = True

    def supports(self, layer) -> bool:
        return super().supports(layer) and hardware.has_any(BF16_DOT_ISA)


class Conv1x1GemmBf16Tactic(Bf16Gemm, Conv1x1GemmTactic):
    name = "kiln.conv2d_1x1_gemm_nhwc_bf16"


class MatMulGemmBf16Tactic(Bf16Gemm, MatMulGemmTactic):
    name = "kiln.matmul_gemm_bf16"


class DirectConvBf16Tactic(Bf16Gemm, DirectConvTactic):
    name = "kiln.conv2d_direct_gemm_nhwc_bf16"
    entry_point = "kiln_conv_bf16"
    pack = staticmethod(pack_bf16_segments)

    def supports(self, layer) -> bool:   # the C kernel's row table holds kernel heights up to 16
        return super().supports(layer) and layer.const_inputs[1].shape[2] <= 16


class DirectConv1dBf16Tactic(Bf16Gemm, DirectConv1dTactic):
    name = "kiln.conv1d_direct_gemm_bf16"
    entry_point = "kiln_conv_bf16"
    pack = staticmethod(pack_bf16_segments)
