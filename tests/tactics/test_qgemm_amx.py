"""kiln's AMX INT8 kernels (qgemm_amx.h) give exactly the VNNI kernels' bytes — integer sums, the same epilogue —
on every quantized convolution and linear case of test_qgemm_c.py (u8 and s8 input, per-channel scales, padding
at the zero point, strides, Clip/Swish, FP32 out, residual + ReLU, weights with zero points, a product rounded
before its bias: test_qgemm_bias.py's cases), and pack each k range to whole 64-byte tile steps. AMX is real where
this CPU has it, else emulated in C (tests/tactics/amx.py)."""
from __future__ import annotations

import pytest
import torch

from kiln.tactics.base import LayerView
from kiln.tactics.qgemm_amx import (
    QConvDirectAmxTactic, QConvGemmAmxTactic, QLinearGemmAmxTactic, pack_amx_quads, pack_amx_segments,
    self_check_passes,
)
from kiln.tactics.qgemm_c import QConvDirectTactic, QConvGemmTactic, QLinearGemmTactic, pack_quads
from tests.conftest import torch_threads
from tests.tactics.amx import amx_int8_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)
from tests.tactics.test_qgemm_bias import CASES as MID_CASES, mid_case
from tests.tactics.test_qgemm_c import (
    CONV_CASES, ZERO_POINT_CASES, assert_requantized_equal, assert_spread, conv_formula, linear_case, linear_formula,
    needs_vnni, qconv_view, quant, rand_q, run, zero_point_case,
)


def test_weights_pad_every_k_range_to_whole_64_byte_steps():
    w = torch.randint(-127, 128, (70, 40), dtype=torch.int8)
    packed = pack_amx_quads(w)
    assert packed.shape == (2, 32, 32, 4)                         # 70 bytes: 18 quads padded to 2 steps of 16
    assert torch.equal(packed[:, :18], pack_quads(w)) and not packed[:, 18:].any()
    rows = torch.randint(-127, 128, (3, 21, 40), dtype=torch.int8)
    segments = pack_amx_segments(rows)
    assert segments.shape == (2, 3 * 16, 32, 4)
    for s in range(3):
        assert torch.equal(segments[:, s * 16:s * 16 + 6], pack_quads(rows[s]))
        assert not segments[:, s * 16 + 6:(s + 1) * 16].any()


@needs_vnni
def test_the_self_check_passes(amx_int8_kernels):
    assert self_check_passes()


@needs_vnni
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_quantized_conv_equals_the_vnni_kernel(case, amx_int8_kernels):
    x_shape, (cout, kh), pads, stride, xq, yq, per_channel, act = CONV_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    w = torch.randint(-127, 128, (cout, x_shape[1], kh, kh), generator=g, dtype=torch.int8)
    x = rand_q(x_shape, xq[0], g)
    view = qconv_view(x_shape, w, quant(cout, xq, yq, per_channel), pads, stride, act)
    amx, vnni = (QConvGemmAmxTactic(), QConvGemmTactic()) if kh == 1 and not any(pads) else \
        (QConvDirectAmxTactic(), QConvDirectTactic())
    assert amx.supports(view)
    got = run(amx, view, [x, None, None])
    assert_spread(got)
    assert torch.equal(got, run(vnni, view, [x, None, None]))
    assert_requantized_equal(got, conv_formula(view, x))   # and the formula the VNNI kernel is held to


@needs_vnni
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("kh,hw,cout", [(3, 7, 160), (1, 7, 96), (3, 5, 64), (1, 11, 130)])
def test_every_work_split_across_threads_gives_the_vnni_kernels_bytes(kh, hw, cout, threads, amx_int8_kernels):
    """Few row blocks (a 7x7 map: 49 rows, two blocks) are split by weight panels as well: each thread takes whole
    panel groups across the blocks (amx.h's amx_unit). Every split covers each output once: the bytes equal the
    VNNI kernel's on one thread."""
    g = torch.Generator().manual_seed(kh * hw + cout)
    x_shape = (1, 24, hw, hw)
    w = torch.randint(-127, 128, (cout, 24, kh, kh), generator=g, dtype=torch.int8)
    x = rand_q(x_shape, "uint8", g)
    pads = (kh // 2,) * 4
    view = qconv_view(x_shape, w, quant(cout, ("uint8", 3, 0.02), ("uint8", 5, 0.05), True), pads, (1, 1), None)
    amx, vnni = (QConvGemmAmxTactic(), QConvGemmTactic()) if kh == 1 else (QConvDirectAmxTactic(), QConvDirectTactic())
    want = run(vnni, view, [x, None, None])
    with torch_threads(threads):
        got = run(amx, view, [x, None, None])
    assert_spread(got)
    assert torch.equal(got, want)
    assert_requantized_equal(got, conv_formula(view, x))   # and the formula both kernels are held to


@needs_vnni
@pytest.mark.parametrize("kh,out,residual", [(3, "uint8", "uint8"), (1, "int8", "int8"), (3, None, None),
                                             (1, None, "float32"), (3, "uint8", "float32")])
def test_residual_relu_and_fp32_out_equal_the_vnni_kernel(kh, out, residual, amx_int8_kernels):
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (40, 16, kh, kh), generator=g, dtype=torch.int8)
    x = rand_q((1, 16, 10, 10), "uint8", g)
    pads = (1,) * 4 if kh == 3 else (0,) * 4
    if residual is None:
        view, xs = qconv_view(tuple(x.shape), w, quant(40, y=None), pads), [x, None, None]
    else:
        r = torch.randn((1, 40, 10, 10), generator=g) if residual == "float32" else rand_q((1, 40, 10, 10), out, g)
        y = None if out is None else (out, 5 if out == "uint8" else -4, 0.05)
        q = quant(40, y=y, r=None if residual == "float32" else (7 if out == "uint8" else 3, 0.03))
        view = qconv_view(tuple(x.shape), w, q, pads, act={"op": "Relu", "attrs": {}}, residual=True,
                          residual_dtype=residual)
        xs = [x, None, None, r.contiguous(memory_format=torch.channels_last)]
    amx, vnni = (QConvDirectAmxTactic(), QConvDirectTactic()) if kh == 3 else (QConvGemmAmxTactic(), QConvGemmTactic())
    got = run(amx, view, xs)
    assert torch.equal(got, run(vnni, view, xs))
    want = conv_formula(view, x, xs[3] if residual else None)   # and the formula: the sum + residual, requantized
    if out is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert_requantized_equal(got, want)


@needs_vnni
@pytest.mark.parametrize("op,x_shape,trans_b,x,y", [
    ("QGemm", (7, 64), 1, ("uint8", 3, 0.02), ("uint8", 5, 0.05)),
    ("QGemm", (1, 50), 0, ("uint8", 9, 0.02), ("int8", 0, 0.8)),
    ("QMatMul", (2, 40, 48), 0, ("int8", -1, 0.03), ("uint8", 128, 0.05)),   # two row blocks per image
    ("QMatMul", (13, 130), 0, ("uint8", 200, 0.02), None)])                  # k past one 64-byte step; FP32 out
def test_quantized_linear_equals_the_vnni_kernel(op, x_shape, trans_b, x, y, amx_int8_kernels):
    view, xs = linear_case(op, x_shape, trans_b, x, y)
    assert QLinearGemmAmxTactic().supports(view)
    got = run(QLinearGemmAmxTactic(), view, [xs, None, None])
    assert torch.equal(got, run(QLinearGemmTactic(), view, [xs, None, None]))
    want = linear_formula(view, xs)
    if y is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert_requantized_equal(got, want)


def amx_twin(vnni):
    """The AMX tactic that runs what the VNNI tactic `vnni` runs."""
    return {QLinearGemmTactic.name: QLinearGemmAmxTactic(), QConvGemmTactic.name: QConvGemmAmxTactic(),
            QConvDirectTactic.name: QConvDirectAmxTactic()}[vnni.name]


@needs_vnni
@pytest.mark.parametrize("make,case", [pytest.param(zero_point_case, c, id=f"zero_points-{c}")
                                       for c in ZERO_POINT_CASES] +
                         [pytest.param(mid_case, c, id=f"mid-{c}") for c in MID_CASES])
def test_zero_point_weights_and_products_rounded_before_their_bias_equal_the_vnni_kernel(make, case,
                                                                                         amx_int8_kernels):
    view, x, vnni = make(case)
    amx = amx_twin(vnni)
    assert amx.supports(view)
    got = run(amx, view, [x, None, None])
    assert torch.equal(got, run(vnni, view, [x, None, None]))
    assert_spread(got)


@needs_vnni
@pytest.mark.parametrize("kind", ["linear", "conv3x3", "conv1x1_residual"])
def test_an_output_table_maps_the_same_bytes_as_the_vnni_kernel(kind, amx_int8_kernels):
    """A product with an output table (kiln.passes.qproduct_table) stores table[byte] from the AMX kernels' shared
    epilogue as from the VNNI kernels' (and the table changed the bytes: it is applied, once)."""
    g = torch.Generator().manual_seed(11)
    entries = torch.randperm(256, generator=g)
    table = {"bytes": entries.tolist(), "dtype": "int8"}
    if kind == "linear":
        view, x = linear_case("QMatMul", (2, 40, 48), 0, ("uint8", 3, 0.02), ("uint8", 5, 0.05))
        xs, vnni = [x, None, None], QLinearGemmTactic()
    else:
        kh, residual = (3, False) if kind == "conv3x3" else (1, True)
        w = torch.randint(-127, 128, (40, 16, kh, kh), generator=g, dtype=torch.int8)
        x = rand_q((1, 16, 10, 10), "uint8", g)
        view = qconv_view(tuple(x.shape), w, quant(40, y=("uint8", 5, 0.05), r=(7, 0.03) if residual else None),
                          (1,) * 4 if kh == 3 else (0,) * 4, residual=residual)
        r = rand_q((1, 40, 10, 10), "uint8", g).contiguous(memory_format=torch.channels_last)
        xs, vnni = [x, None, None] + ([r] if residual else []), QConvDirectTactic() if kh == 3 else QConvGemmTactic()
    tabled = LayerView(**{**view.__dict__, "attrs": {**view.attrs, "out_table": table}, "output_dtypes": ("int8",)})
    amx = amx_twin(vnni)
    assert amx.supports(tabled)
    plain, got = run(vnni, view, xs), run(amx, tabled, xs)
    want = linear_formula(view, x) if kind == "linear" else conv_formula(view, x, r if kind != "conv3x3" else None)
    assert_requantized_equal(plain, want)   # the bytes the table maps: the product's, by the formula
    assert got.dtype == torch.int8 and torch.equal(got, run(vnni, tabled, xs))
    assert torch.equal(got.view(torch.uint8), entries.to(torch.uint8)[plain.view(torch.uint8).long()])
