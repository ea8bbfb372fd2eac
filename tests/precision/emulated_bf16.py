"""BF16 numerics on any CPU: where the CPU lacks native BF16 arithmetic (the AVX2 machines), the accuracy-budget
tests still run, on stand-ins for kiln's BF16 linear kernel that round the activations, the weights and the output
to bfloat16 and compute in FP32 between (what oneDNN's BF16 kernels do: BF16 operands, FP32 accumulation). On a
CPU with BF16 the real kernels run and nothing is replaced."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.tactics import registry
from kiln.tactics.base import has_residual, storage_dtype
from kiln.tactics.onednn_conv import bf16_available, finisher, sums_in_compute_type
from kiln.tactics.onednn_linear import OneDnnBf16LinearTactic, OneDnnLinearTactic


def to_bf16(t):
    return t.bfloat16().float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class EmulatedBf16Linear(OneDnnLinearTactic):
    """Stores its output as the real kernel does (bf16 where the plan keeps the tensor bf16), so the accuracy
    budget's ranking, which rounds the tensors a layer writes, sees the same harm on either CPU."""

    name = OneDnnBf16LinearTactic.name + ".emulated"
    reduced_precisions = frozenset({"BF16"})
    bf16_inputs = OneDnnBf16LinearTactic.bf16_inputs
    writes_bf16 = True

    def prepare(self, layer):
        floats = tuple("float32" if d == "bfloat16" else d for d in layer.input_dtypes)
        fp32 = dataclasses.replace(layer, input_dtypes=floats, output_dtypes=("float32",),
                                   const_inputs={i: to_bf16(t) for i, t in layer.const_inputs.items()})
        if has_residual(layer) and not sums_in_compute_type(layer, torch.bfloat16):
            return self.product_then_add(layer, fp32)
        kernel = super().prepare(fp32)
        store = storage_dtype(layer.output_dtypes[0])
        return lambda xs: [to_bf16(y).to(store) for y in kernel([to_bf16(x) for x in xs])]

    def product_then_add(self, layer, fp32):
        """As the real kernel's residual_kernel where the sum would round what the plan keeps in FP32: the product
        rounded to bf16 alone, the residual added in FP32, then the activation."""
        product = super().prepare(dataclasses.replace(
            fp32, input_shapes=fp32.input_shapes[:3], input_dtypes=fp32.input_dtypes[:3],
            input_dynamic=fp32.input_dynamic[:3], attrs={k: v for k, v in fp32.attrs.items() if k != "activation"}))
        finish = finisher(layer.attrs.get("activation"), layer.output_dtypes[0])
        return lambda xs: finish(to_bf16(product([to_bf16(xs[0])])[0]) + xs[3].float())


@pytest.fixture
def bf16_kernels(monkeypatch):
    """The real BF16 kernels where the CPU has them, else the emulation (reported as such in TacticName)."""
    if bf16_available():
        return "native"
    emulated = EmulatedBf16Linear()
    for op in ("MatMul", "Gemm"):
        monkeypatch.setitem(registry.REGISTRY, op, [t for t in registry.REGISTRY[op]
                                                    if not isinstance(t, OneDnnBf16LinearTactic)] + [emulated])
    monkeypatch.setitem(registry.TACTICS_BY_NAME, emulated.name, emulated)
    monkeypatch.setattr("kiln.precision.policy.cpu_reduced_float_support", lambda: {"FP16": False, "BF16": True})
    return "emulated"
