"""kiln's AMX BF16 kernels beyond the formula tests they share with the vdpbf16ps ones (test_gemm_bf16.py): weights
padded to whole tile steps; bf16-stored inputs, outputs and residuals give what the vdpbf16ps kernel gives; the
self-check; offered only where AMX is usable; an engine built with them loads on a CPU without AMX onto their
vdpbf16ps siblings, with one warning each. AMX is real where this CPU has it, else emulated (tests/tactics/amx.py)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import hardware, native
from kiln.tactics import gemm_amx, registry
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_amx import (
    DirectConvAmxTactic, MatMulGemmAmxTactic, pack_amx_pairs, pack_amx_segments, self_check_error,
)
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, DirectConvBf16Tactic, pack_bf16_pairs
from tests.precision.models import conv_net
from tests.conftest import torch_threads
from tests.tactics.amx import amx_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)

needs_bf16 = pytest.mark.skipif(not (hardware.has_any(BF16_DOT_ISA) and native.available()),
                                reason="this CPU has no AVX512-BF16 or there is no C compiler: gemm.c's BF16 section "
                                "(AMX kernels and their emulation included) is not compiled here")


def test_weights_pad_every_k_range_to_whole_tile_steps():
    b = torch.arange(5 * 40, dtype=torch.float32).reshape(5, 40)
    packed = pack_amx_pairs(b)
    assert packed.shape == (2, 16, 32)                          # 3 pairs padded to one step of 16
    assert torch.equal(packed[:, :3], pack_bf16_pairs(b)) and not packed[:, 3:].any()
    w = torch.randn(3, 21, 40)                                  # a 7x7 stem's kernel rows: 21 values, 11 pairs each
    segments = pack_amx_segments(w)
    assert segments.shape == (2, 3 * 16, 32)
    for s in range(3):
        assert torch.equal(segments[:, s * 16:s * 16 + 11], pack_bf16_pairs(w[s]))
        assert not segments[:, s * 16 + 11:(s + 1) * 16].any()


@needs_bf16
def test_the_self_check_agrees_with_the_vdpbf16ps_gemm(amx_kernels):
    assert self_check_error() < 1e-5


def conv_view(dtypes: tuple[str, str, str], c=24, hw=9, cout=40):
    """A 3x3 convolution (pad 1) + residual + ReLU whose input, residual and output are stored as `dtypes`."""
    g = torch.Generator().manual_seed(21)
    weight, bias = torch.randn(cout, c, 3, 3, generator=g), torch.randn(cout, generator=g)
    shapes = ((1, c, hw, hw), (cout, c, 3, 3), (cout,), (1, cout, hw, hw))
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1,
             "activation": {"op": "Relu", "attrs": {}}}
    return LayerView("Conv", "", attrs, shapes, (dtypes[0], "float32", "float32", dtypes[1]),
                     {1: weight, 2: bias}, (dtypes[2],), 17, ((),) * 4)


@needs_bf16
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16", "bfloat16"), ("float32", "float32", "bfloat16"),
                                    ("bfloat16", "float32", "float32")])
def test_bf16_storage_reads_and_writes_as_the_vdpbf16ps_kernel_does(dtypes, amx_kernels):
    view = conv_view(dtypes)
    g = torch.Generator().manual_seed(22)
    as_stored = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    x = torch.randn(1, 24, 9, 9, generator=g).to(as_stored[dtypes[0]]).contiguous(memory_format=torch.channels_last)
    r = torch.randn(1, 40, 9, 9, generator=g).to(as_stored[dtypes[1]]).contiguous(memory_format=torch.channels_last)
    amx, vdp = (t.prepare(view)([x, None, None, r])[0] for t in (DirectConvAmxTactic(), DirectConvBf16Tactic()))
    assert amx.dtype == vdp.dtype == as_stored[dtypes[2]]
    torch.testing.assert_close(amx.float(), vdp.float(), rtol=8e-3, atol=1e-3)   # within a bf16 rounding step
    w, bias = (view.const_inputs[i] for i in (1, 2))   # and the formula: bf16 operands, FP32 sums and epilogue
    want = torch.relu(F.conv2d(x.bfloat16().float(), w.bfloat16().float(), bias, padding=1) + r.float())
    torch.testing.assert_close(amx.float(), want.to(as_stored[dtypes[2]]).float(), rtol=8e-3, atol=2e-3)


@needs_bf16
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("hw,cout", [(7, 160), (11, 96)])
def test_every_work_split_across_threads_gives_the_one_thread_result(hw, cout, threads, amx_kernels):
    """Few row blocks (7x7: 49 rows) are split by weight panels too (amx.h's amx_unit): on any thread count each
    output is computed once, in the same order of sums, so the result equals one thread's exactly, and both the
    formula: bf16 operands, FP32 sums and epilogue."""
    view = conv_view(("float32", "float32", "float32"), hw=hw, cout=cout)
    g = torch.Generator().manual_seed(hw)
    x = torch.randn(1, 24, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    r = torch.randn(1, cout, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    kernel = DirectConvAmxTactic().prepare(view)
    want = kernel([x, None, None, r])[0].clone()
    with torch_threads(threads):
        got = kernel([x, None, None, r])[0]
    assert torch.equal(got, want) and want.abs().sum() > 0
    w, bias = (view.const_inputs[i] for i in (1, 2))
    formula = torch.relu(F.conv2d(x.bfloat16().float(), w.bfloat16().float(), bias, padding=1) + r)
    torch.testing.assert_close(got, formula, rtol=8e-3, atol=2e-3)


def test_not_offered_where_amx_is_missing(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    gemm_amx.amx_usable.cache_clear()
    try:
        view = LayerView("MatMul", "", {}, ((4, 64), (64, 32)), ("float32", "float32"), {1: torch.randn(64, 32)},
                         ("float32",), 17, ((), ()))
        assert not gemm_amx.amx_usable() and not MatMulGemmAmxTactic().supports(view)
    finally:
        gemm_amx.amx_usable.cache_clear()


@needs_bf16
def test_an_amx_engine_loads_onto_the_vdpbf16ps_kernels_where_amx_is_missing(amx_kernels, monkeypatch, tmp_path,
                                                                              caplog):
    amx_first = {op: sorted(registry.REGISTRY[op], key=lambda t: not isinstance(t, gemm_amx.AmxGemm))
                 for op in ("Conv", "MatMul", "Gemm")}
    for op, tactics in amx_first.items():
        monkeypatch.setitem(registry.REGISTRY, op, tactics)
    engine = kiln.build(conv_net(), bf16=True, precision_constraints="prefer", tactic_sources="kiln", autotune=False,
                        accuracy="off")
    amx_layers = sorted(l.name for l in engine.plan.layers if l.tactic_name.endswith("_amx_bf16"))
    assert amx_layers == ["conv1 + relu1", "conv2 + relu2", "fc", "head"], \
        [(l.name, l.tactic_name) for l in engine.plan.layers]
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)
    want = engine.run({"x": x})["y"]
    engine.save(tmp_path / "amx.kiln")
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}))
    caplog.set_level(logging.WARNING, logger="kiln.runtime")
    loaded = kiln.load(tmp_path / "amx.kiln", allow_other_device=True)
    np.testing.assert_allclose(loaded.run({"x": x})["y"], want, rtol=1e-3, atol=1e-3)
    warned = sorted(r.getMessage().split(" needs ")[0] for r in caplog.records if "needs amx_bf16" in r.getMessage())
    assert warned == ["kiln.conv2d_direct_gemm_nhwc_amx_bf16", "kiln.matmul_gemm_amx_bf16"]   # once per kernel
