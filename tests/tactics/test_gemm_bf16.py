"""kiln's own BF16 GEMM, on vdpbf16ps and on AMX tiles (real where this CPU has AMX, else gemm.c built with
-DKILN_AMX_EMULATE: tests/tactics/amx.py): 1x1 convolutions, direct convolutions and linear layers against the
formula they compute (operands rounded to bf16, products summed in FP32, bias, residual and ReLU in FP32), ragged
sizes included; the weight packing's layout on every CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import hardware, native
from kiln.tactics import gemm_c
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_amx import Conv1x1GemmAmxTactic, DirectConvAmxTactic, MatMulGemmAmxTactic
from kiln.tactics.gemm_bf16 import (
    BF16_DOT_ISA, Conv1x1GemmBf16Tactic, DirectConvBf16Tactic, MatMulGemmBf16Tactic, pack_bf16_pairs,
)
from tests.tactics.amx import amx_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)

needs_bf16 = pytest.mark.skipif(not (hardware.has_any(BF16_DOT_ISA) and native.available()),
                                reason="this CPU has no AVX512-BF16 (vdpbf16ps) or there is no C compiler: kiln's "
                                "BF16 GEMM is not offered here")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def tactic_of(kind: str, request, vdpbf16ps, amx):
    """The tactic under test: the vdpbf16ps one, or the AMX one with AMX real or emulated (fixture amx_kernels)."""
    if kind == "amx":
        request.getfixturevalue("amx_kernels")
        return amx
    return vdpbf16ps


both_kernels = pytest.mark.parametrize("kind", ["vdpbf16ps", "amx"])


def test_weights_pack_as_bf16_pairs_in_32_column_panels():
    k, n = 5, 40                                            # odd k and a partial second panel
    b = torch.arange(k * n, dtype=torch.float32).reshape(k, n)
    packed = pack_bf16_pairs(b)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3, gemm_c.PANEL)
    halves = packed.view(torch.bfloat16).reshape(2, 3, gemm_c.PANEL, 2).float()
    for col in (0, 31, 32, 39):
        panel, lane = divmod(col, gemm_c.PANEL)
        for row in range(k):
            assert halves[panel, row // 2, lane, row % 2] == bf16(b[row, col])
    assert halves[0, 2, :, 1].abs().sum() == 0              # the pad row of odd k
    assert halves[1, :, 8:, :].abs().sum() == 0             # columns past n


def conv_view(n, c, h, w, cout, stride=1, residual=False, act=None):
    g = torch.Generator().manual_seed(11)
    consts = {1: torch.randn(cout, c, 1, 1, generator=g), 2: torch.randn(cout, generator=g)}
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    shapes = ((n, c, h, w), (cout, c, 1, 1), (cout,)) + (((n, cout, oh, ow),) if residual else ())
    attrs = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [stride] * 2, "dilations": [1, 1], "group": 1,
             **({"activation": {"op": act, "attrs": {}}} if act else {})}
    return LayerView("Conv", "", attrs, shapes, ("float32",) * len(shapes), consts, ("float32",), 17,
                     tuple(() for _ in shapes))


@needs_bf16
@both_kernels
@pytest.mark.parametrize("n,c,h,w,cout,stride,residual,act", [
    (1, 64, 7, 9, 96, 1, False, None),       # 63 rows: a partial row tile; 3 full panels
    (2, 45, 5, 5, 40, 1, True, "Relu"),      # odd k, a partial panel, batch 2, residual + ReLU
    (1, 32, 9, 9, 64, 2, False, "Relu"),     # strided: rows read in place
])
def test_bf16_1x1_convolution_matches_its_formula(n, c, h, w, cout, stride, residual, act, kind, request):
    view = conv_view(n, c, h, w, cout, stride, residual, act)
    tactic = tactic_of(kind, request, Conv1x1GemmBf16Tactic(), Conv1x1GemmAmxTactic())
    assert tactic.supports(view)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, c, h, w, generator=g).contiguous(memory_format=torch.channels_last)
    r = torch.randn(n, cout, (h - 1) // stride + 1, (w - 1) // stride + 1, generator=g) if residual else None
    got = tactic.prepare(view)([x, None, None] + ([r] if residual else []))[0]
    want = F.conv2d(bf16(x), bf16(view.const_inputs[1]), view.const_inputs[2], stride)
    if residual:
        want = want + r
    if act:
        want = torch.relu(want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    exact = F.conv2d(x, view.const_inputs[1], view.const_inputs[2], stride) + (r if residual else 0)
    exact = torch.relu(exact) if act else exact
    cos = F.cosine_similarity(got.flatten(), exact.flatten(), dim=0)
    assert 0.999 < cos < 1.0                                  # BF16 is visibly not FP32, and close to it


@needs_bf16
@both_kernels
@pytest.mark.parametrize("x_shape,n,gelu", [((1, 7, 48), 33, None), ((5, 768), 64, "none"), ((2, 40, 75), 70, "tanh")])
def test_bf16_linear_matches_its_formula(x_shape, n, gelu, kind, request):
    """x·W in bf16 with FP32 sums, then GELU (erf or tanh form) in FP32 where the layer has it."""
    g = torch.Generator().manual_seed(13)
    w = torch.randn(x_shape[-1], n, generator=g)
    attrs = {"activation": {"op": "Gelu", "attrs": {"approximate": gelu}}} if gelu else {}
    view = LayerView("MatMul", "", attrs, (x_shape, tuple(w.shape)), ("float32", "float32"), {1: w}, ("float32",),
                     17, ((), ()))
    tactic = tactic_of(kind, request, MatMulGemmBf16Tactic(), MatMulGemmAmxTactic())
    assert tactic.supports(view)
    x = torch.randn(x_shape, generator=g)
    got = tactic.prepare(view)([x, None])[0]
    want = bf16(x) @ bf16(w)
    torch.testing.assert_close(got, F.gelu(want, approximate=gelu) if gelu else want, rtol=1e-4, atol=1e-4)


def test_bf16_gemm_is_not_offered_without_avx512_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f", "amx_bf16"}))
    assert not Conv1x1GemmBf16Tactic().supports(conv_view(1, 8, 4, 4, 8))


@needs_bf16
@both_kernels
@pytest.mark.parametrize("c,hw,cout,k,stride,pads,residual", [
    (16, 9, 40, 3, 1, (1, 1, 1, 1), True),        # borders copied with zeros, residual + ReLU
    (3, 15, 32, 7, 2, (3, 3, 3, 3), False),       # a stem: odd segments (7 * 3 = 21 floats)
    (24, 8, 64, 3, 2, (0, 0, 1, 1), False),       # asymmetric padding, strided
])
def test_bf16_direct_convolution_matches_its_formula(c, hw, cout, k, stride, pads, residual, kind, request):
    g = torch.Generator().manual_seed(14)
    weight, bias = torch.randn(cout, c, k, k, generator=g), torch.randn(cout, generator=g)
    x = torch.randn(2, c, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    xp = F.pad(x, [pads[1], pads[3], pads[0], pads[2]])
    want = F.conv2d(bf16(xp), bf16(weight), bias, stride)
    r = torch.randn(want.shape, generator=g) if residual else None
    shapes = ((2, c, hw, hw), tuple(weight.shape), (cout,)) + ((tuple(want.shape),) if residual else ())
    attrs = {"kernel_shape": [k, k], "pads": list(pads), "strides": [stride] * 2, "dilations": [1, 1], "group": 1,
             **({"activation": {"op": "Relu", "attrs": {}}} if residual else {})}
    view = LayerView("Conv", "", attrs, shapes, ("float32",) * len(shapes), {1: weight, 2: bias}, ("float32",), 17,
                     tuple(() for _ in shapes))
    tactic = tactic_of(kind, request, DirectConvBf16Tactic(), DirectConvAmxTactic())
    assert tactic.supports(view)
    got = tactic.prepare(view)([x, None, None] + ([r] if residual else []))[0]
    if residual:
        want = torch.relu(want + r)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
