"""Attention in BF16: kiln's fused Attention layer (Q·Kᵀ, scale, mask, softmax, ·V) on torch's scaled-dot-product
kernel with bf16 operands; torch's CPU kernel accumulates the softmax and the products in FP32 (its accumulate type
for reduced floats), which is what the issue asks of a BF16 attention. Q, K, V and the output are FP32 or bf16, as
the plan stores them (kiln.tactics.storage).

On Zen 4 without AMX it loses to FP32 (BERT-base's 12x128x64 heads: 0.68 against 0.59 ms, the casts included), so
the autotuner keeps FP32 there; on AMX CPUs oneDNN's bf16 kernels behind it are the ones that pay."""
from __future__ import annotations

import torch

from kiln import hardware
from kiln.ops import lookup
from kiln.tactics.base import LINEAR, Kernel, LayerView
from kiln.tactics.onednn_conv import bf16_available


class Bf16AttentionTactic:
    name = "torch.attention_sdpa_bf16"
    source = "torch"
    reduced_precisions = frozenset({"BF16"})
    required_isa = hardware.BF16_ISA
    bf16_inputs = frozenset({0, 1, 2})   # Q, K, V as the plan stores them (kiln.tactics.storage)
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        return (layer.op_type == "Attention" and layer.domain == "kiln" and layer.output_dtypes == ("float32",)
                and all(d in (None, "float32") for d in layer.input_dtypes[:3]) and bf16_available())

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        impl, attrs = lookup("Attention", "kiln").impl, layer.attrs
        consts = layer.const_inputs

        def to_bf16(t):
            return t.to(torch.bfloat16) if t is not None and t.is_floating_point() else t

        out = torch.bfloat16 if layer.output_dtypes[0] == "bfloat16" else torch.float32

        def run(xs):
            args = [to_bf16(consts.get(i, x)) for i, x in enumerate(xs)]
            return [y.to(out) for y in impl(attrs, args)]
        return run
