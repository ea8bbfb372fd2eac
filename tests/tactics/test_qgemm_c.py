"""kiln's own INT8 kernels on AVX512-VNNI (kiln/native/csrc/qgemm.c): quantized convolutions (1x1 as a GEMM,
others direct) and linear layers against the formula they implement (dequantize, FP32 op, + residual, activation,
requantize) and against oneDNN's INT8 kernels layer by layer, then a quantize_static ResNet built on them against
onnxruntime. Requantized outputs must equal oneDNN's except for rare off-by-one roundings (the same sum scaled in
another order): at most 1 step apart, at least 99 % identical."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, OneDnnInt8LinearTactic, int8_available
from kiln.tactics.qgemm_c import (QConvDirectTactic, QConvGemmTactic, QLinearGemmTactic, VNNI_ISA,
                                  pack_quads, pack_segments)
from tests.conftest import cosine, run_ort

needs_vnni = pytest.mark.skipif(not (hardware.has_any(VNNI_ISA) and native.available()),
                                reason="this CPU has no AVX512-VNNI (vpdpbusd) or there is no C compiler: kiln's INT8 "
                                "kernels are not offered here")
QTACTICS = ("kiln.qconv2d_1x1_gemm_nhwc_int8", "kiln.qconv2d_direct_nhwc_int8", "kiln.qmatmul_gemm_int8")
RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
TORCH = {"uint8": torch.uint8, "int8": torch.int8}


def quant(k, x=("uint8", 3, 0.02), y=("uint8", 5, 0.05), per_channel=True, r=None, axis=0):
    q = {"x_dtype": x[0], "x_zero_point": x[1], "x_scale": x[2], "w_axis": axis,
         "w_scale": [0.003 + 0.0004 * i for i in range(k)] if per_channel else [0.004],
         "w_zero_point": [0] * (k if per_channel else 1)}
    if y:
        q.update(y_dtype=y[0], y_zero_point=y[1], y_scale=y[2])
    if r:
        q.update(r_zero_point=r[0], r_scale=r[1])
    return q


def rand_q(shape, dtype, g):
    lo, hi = RANGES[dtype]
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=TORCH[dtype])


def qconv_view(x_shape, w, q, pads=(0, 0, 0, 0), stride=(1, 1), act=None, residual=False, group=1, dilation=1,
               residual_dtype=None):
    """A QConv's LayerView; a residual is of the output's type unless `residual_dtype` says otherwise."""
    k = w.shape[0]
    consts = {1: w, 2: torch.linspace(-2, 2, k)}
    attrs = {"pads": list(pads), "strides": list(stride), "dilations": [dilation] * 2, "group": group,
             "kernel_shape": list(w.shape[2:]), "quant": q, **({"activation": act} if act else {})}
    out_dtype = q.get("y_dtype", "float32") if "y_scale" in q else "float32"
    shapes, dtypes = [x_shape, tuple(w.shape), (k,)], [q["x_dtype"], str(w.dtype)[6:], "float32"]
    if residual:
        view = qconv_view(x_shape, w, q, pads, stride)
        oh, ow = conv_out_hw(view)
        shapes.append((x_shape[0], k, oh, ow))
        dtypes.append(residual_dtype or out_dtype)
    return LayerView("QConv", "kiln", attrs, tuple(shapes), tuple(dtypes), consts, (out_dtype,))


def conv_out_hw(view):
    (_, _, h, w), (kh, kw) = view.input_shapes[0], view.const_inputs[1].shape[2:]
    pt, pl, pb, pr = view.attrs["pads"]
    sh, sw = view.attrs["strides"]
    return (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1


def requantize(y, q):
    if "y_scale" not in q:
        return y
    lo, hi = RANGES[q["y_dtype"]]
    return torch.clamp(torch.round(y / q["y_scale"]) + q["y_zero_point"], lo, hi)


def conv_formula(view, x, residual=None):
    """Dequantize, pad with zeros (a quantized zero point), FP32 convolution, + residual, activation, requantize."""
    q, a = view.attrs["quant"], view.attrs
    w = centred(view).float() * torch.tensor(q["w_scale"]).view(-1, 1, 1, 1)
    xf = F.pad((x.float() - q["x_zero_point"]) * q["x_scale"], [a["pads"][1], a["pads"][3], a["pads"][0], a["pads"][2]])
    y = F.conv2d(xf.double(), w.double(), view.const_inputs[2].double(), a["strides"]).float()
    if residual is not None and residual.is_floating_point():   # an unquantized (FP32) sum
        y = y + residual
    elif residual is not None:
        y = y + (residual.float() - q["r_zero_point"]) * q["r_scale"]
    spec = a.get("activation")
    if spec and spec["op"] == "Relu":
        y = torch.relu(y)
    elif spec and spec["op"] == "Clip":
        y = torch.clamp(y, spec["attrs"]["min"], spec["attrs"]["max"])
    elif spec and spec["op"] == "Gelu":
        y = F.gelu(y.double(), approximate=spec["attrs"].get("approximate", "none")).float()
    elif spec:
        y = F.silu(y)
    return requantize(y, q)


def centred(view):
    """W - W_zp in float64, the zero points along the weights' `w_axis`."""
    q, w = view.attrs["quant"], view.const_inputs[1]
    zp = torch.tensor(q["w_zero_point"], dtype=torch.float64)
    return w.double() - zp.reshape((-1,) + (1,) * (w.dim() - 1 - q["w_axis"]))


def run(tactic, view, xs):
    return tactic.prepare(view)(xs)[0]


def assert_requantized_equal(got, want):
    """Identical but for the last rounding step: at most 1 apart, on at most 1 % of the values."""
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 1, diff.max()
    assert (diff == 0).float().mean() >= 0.99


def assert_spread(out):   # a kernel that saturates or zeroes everything would match a formula that does too
    assert torch.unique(out).numel() >= 20


CONV_CASES = {
    # name: (x shape, (cout, kh), pads, stride, x (dtype, zp, scale), y, per-channel, activation)
    "3x3_per_channel_relu": ((2, 24, 13, 11), (40, 3), (1, 1, 1, 1), (1, 1), ("uint8", 3, 0.02), ("uint8", 5, 0.05),
                             True, {"op": "Relu", "attrs": {}}),
    "stem_7x7_s2_cin3": ((1, 3, 30, 27), (64, 7), (3, 3, 3, 3), (2, 2), ("uint8", 120, 0.02), ("uint8", 0, 0.1),
                         False, {"op": "Relu", "attrs": {}}),
    "1x1": ((1, 64, 7, 9), (48, 1), (0, 0, 0, 0), (1, 1), ("uint8", 7, 0.02), ("uint8", 128, 0.06), True, None),
    "1x1_cin6_strided": ((2, 6, 11, 9), (33, 1), (0, 0, 0, 0), (2, 2), ("uint8", 200, 0.02), ("int8", -3, 0.01),
                         True, None),
    "s8_in_asym_pads_big_zp": ((1, 13, 9, 10), (20, 3), (0, 1, 2, 3), (2, 1), ("int8", 90, 0.02),
                               ("int8", -3, 0.04), True, None),
    "s8_in_1x1": ((1, 16, 5, 5), (8, 1), (0, 0, 0, 0), (1, 1), ("int8", -2, 0.03), ("uint8", 100, 0.05), False, None),
    "5x5_clip": ((1, 8, 12, 12), (16, 5), (2, 2, 2, 2), (1, 1), ("uint8", 50, 0.02), ("uint8", 10, 0.02), True,
                 {"op": "Clip", "attrs": {"min": 0.0, "max": 4.0}}),
    "3x3_swish": ((1, 8, 6, 6), (16, 3), (1, 1, 1, 1), (1, 1), ("uint8", 50, 0.02), ("int8", -20, 0.03), True,
                  {"op": "Swish", "attrs": {}}),
    "3x3_gelu": ((1, 8, 6, 6), (16, 3), (1, 1, 1, 1), (1, 1), ("uint8", 50, 0.02), ("int8", -20, 0.03), True,
                 {"op": "Gelu", "attrs": {}}),
    "1x1_gelu_tanh": ((1, 16, 5, 7), (24, 1), (0, 0, 0, 0), (1, 1), ("uint8", 90, 0.03), ("int8", -40, 0.02), True,
                      {"op": "Gelu", "attrs": {"approximate": "tanh"}}),
}


@needs_vnni
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_quantized_conv_matches_its_formula_and_onednn(case):
    x_shape, (cout, kh), pads, stride, xq, yq, per_channel, act = CONV_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    w = torch.randint(-127, 128, (cout, x_shape[1], kh, kh), generator=g, dtype=torch.int8)
    x = rand_q(x_shape, xq[0], g)
    view = qconv_view(x_shape, w, quant(cout, xq, yq, per_channel), pads, stride, act)
    tactic = QConvGemmTactic() if kh == 1 and not any(pads) else QConvDirectTactic()
    assert tactic.supports(view) and not (QConvGemmTactic() if tactic.name != QConvGemmTactic.name
                                          else QConvDirectTactic()).supports(view)
    got = run(tactic, view, [x, None, None])
    assert got.dtype == TORCH[yq[0]] and got.shape == (x_shape[0], cout, *conv_out_hw(view))
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_spread(got)
    assert_requantized_equal(got, conv_formula(view, x))
    if OneDnnInt8ConvTactic().supports(view):          # Clip and Swish are fused there too; on any VNNI CPU
        assert_requantized_equal(got, run(OneDnnInt8ConvTactic(), view, [x, None, None]))


@needs_vnni
def test_padded_pixels_count_as_the_zero_point_at_every_border():
    """A constant input equal to the zero point is zero everywhere, padding included: every output is the bias
    alone; off by the zero point's compensation at a border would show at the edges."""
    w = torch.randint(-127, 128, (32, 5, 3, 3), generator=torch.Generator().manual_seed(9), dtype=torch.int8)
    for dtype, zp in (("uint8", 173), ("int8", -77)):
        q = quant(32, (dtype, zp, 0.02), None)
        view = qconv_view((1, 5, 6, 7), w, q, (2, 1, 0, 3), (1, 2))
        x = torch.full((1, 5, 6, 7), zp, dtype=TORCH[dtype])
        got = run(QConvDirectTactic(), view, [x, None, None])
        torch.testing.assert_close(got, view.const_inputs[2].view(1, -1, 1, 1).expand_as(got), rtol=0, atol=1e-6)


@needs_vnni
def test_int8_in_fp32_out_conv_writes_the_dequantized_sum():
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (12, 8, 3, 3), generator=g, dtype=torch.int8)
    x = rand_q((1, 8, 9, 9), "uint8", g)
    view = qconv_view(tuple(x.shape), w, quant(12, y=None), (1, 1, 1, 1))
    got = run(QConvDirectTactic(), view, [x, None, None])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, conv_formula(view, x), rtol=1e-5, atol=1e-4)
    if int8_available():
        torch.testing.assert_close(got, run(OneDnnInt8ConvTactic(), view, [x, None, None]), rtol=1e-5, atol=1e-4)


@needs_vnni
@pytest.mark.parametrize("kh,out", [(3, "uint8"), (1, "int8")])
def test_residual_sum_and_relu_fuse_and_may_write_over_the_dead_residual(kh, out):
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (40, 16, kh, kh), generator=g, dtype=torch.int8)
    x = rand_q((1, 16, 10, 10), "uint8", g)
    r = rand_q((1, 40, 10, 10), out, g).contiguous(memory_format=torch.channels_last)
    q = quant(40, y=(out, 5 if out == "uint8" else -4, 0.05), r=(7 if out == "uint8" else 3, 0.03))
    view = qconv_view(tuple(x.shape), w, q, (1,) * 4 if kh == 3 else (0,) * 4, act={"op": "Relu", "attrs": {}},
                      residual=True)
    kernel = (QConvDirectTactic() if kh == 3 else QConvGemmTactic()).prepare(view)
    want, kept = conv_formula(view, x, r), r.clone()
    got = kernel([x, None, None, r])[0]
    assert_spread(got)
    assert_requantized_equal(got, want)
    assert torch.equal(r, kept)                            # the plain call leaves a live residual alone
    if int8_available():
        assert_requantized_equal(got, run(OneDnnInt8ConvTactic(), view, [x, None, None, r]))
    index, into = kernel.into_input
    dead = r.clone()
    assert index == 3 and into([x, None, None, dead])[0].data_ptr() == dead.data_ptr()
    assert torch.equal(dead, got)


@needs_vnni
@pytest.mark.parametrize("kh,out", [(3, None), (1, None), (3, "uint8"), (1, "int8")])
def test_an_fp32_residual_sums_before_relu_whatever_the_output_type(kh, out):
    """A TensorRT-style QAT export leaves the residual sum unquantized: the convolution adds an FP32 residual to its
    dequantized sum, then ReLU, and writes FP32 (over the residual's dead buffer, if the runtime offers it) or
    requantizes."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (40, 16, kh, kh), generator=g, dtype=torch.int8)
    x = rand_q((1, 16, 10, 10), "uint8", g)
    r = torch.randn((1, 40, 10, 10), generator=g).contiguous(memory_format=torch.channels_last)
    q = quant(40, y=None if out is None else (out, 5 if out == "uint8" else -4, 0.05))
    view = qconv_view(tuple(x.shape), w, q, (1,) * 4 if kh == 3 else (0,) * 4, act={"op": "Relu", "attrs": {}},
                      residual=True, residual_dtype="float32")
    tactic = QConvDirectTactic() if kh == 3 else QConvGemmTactic()
    assert tactic.supports(view)
    if int8_available():
        assert not OneDnnInt8ConvTactic().supports(view)   # its sum post-op takes the output's type only
    kernel = tactic.prepare(view)
    want, kept = conv_formula(view, x, r), r.clone()
    got = kernel([x, None, None, r])[0]
    zero = 0 if out is None else q["y_zero_point"]   # ReLU's floor, as stored
    assert torch.equal(r, kept) and (got == zero).any() and (got != zero).any()
    if out is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert_requantized_equal(got, want)
    dead = r.clone()
    written = kernel.into_input[1]([x, None, None, dead])[0]
    assert torch.equal(written, got)
    assert (written.data_ptr() == dead.data_ptr()) == (out is None)   # over the residual only where types match


def linear_view(op, x_shape, w, q, trans_b=0):
    n = w.shape[0] if trans_b else w.shape[1]
    attrs = {"quant": q, **({"transB": trans_b} if op == "QGemm" else {})}
    out = q["y_dtype"] if "y_scale" in q else "float32"
    return LayerView(op, "kiln", attrs, (x_shape, tuple(w.shape), (n,)), (q["x_dtype"], str(w.dtype)[6:], "float32"),
                     {1: w, 2: torch.linspace(-1, 1, n)}, (out,))


def linear_formula(view, x):
    q = view.attrs["quant"]
    w = centred(view)
    w = w.t() if view.attrs.get("transB", 0) else w
    y = ((x.double() - q["x_zero_point"]) * q["x_scale"]) @ (w * torch.tensor(q["w_scale"]).double())
    return requantize((y + view.const_inputs[2]).float(), q)


def linear_case(op, x_shape, trans_b, x, y, n=70):
    """A QGemm/QMatMul view by s8 weights of `n` columns (per-column scales) and its quantized input."""
    g = torch.Generator().manual_seed(4)
    k = x_shape[-1]
    w = torch.randint(-127, 128, (n, k) if trans_b else (k, n), generator=g, dtype=torch.int8)
    xs = rand_q(x_shape, x[0], g)
    return linear_view(op, x_shape, w, quant(n, x, y, axis=0 if trans_b else 1), trans_b), xs


@needs_vnni
@pytest.mark.parametrize("op,x_shape,trans_b,x,y", [
    ("QGemm", (7, 64), 1, ("uint8", 3, 0.02), ("uint8", 5, 0.05)),       # rows not a multiple of 6
    ("QGemm", (1, 50), 0, ("uint8", 9, 0.02), ("int8", 0, 0.8)),         # k not a multiple of 4
    ("QMatMul", (2, 5, 48), 0, ("int8", -1, 0.03), ("uint8", 128, 0.05)),
    ("QMatMul", (13, 30), 0, ("uint8", 200, 0.02), None)])               # FP32 out
def test_quantized_linear_matches_its_formula_and_onednn(op, x_shape, trans_b, x, y):
    view, xs = linear_case(op, x_shape, trans_b, x, y)
    assert QLinearGemmTactic().supports(view)
    got = run(QLinearGemmTactic(), view, [xs, None, None])
    assert got.shape == (*x_shape[:-1], 70)
    for want in [linear_formula(view, xs)] + ([run(OneDnnInt8LinearTactic(), view, [xs, None, None])]
                                              if int8_available() else []):
        if y is None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert got.dtype == TORCH[y[0]]
            assert_spread(got)
            assert_requantized_equal(got, want)


def with_weight_zero_points(view, w, zero_points):
    """`view` with weights `w` (s8 or u8) and their zero points (one, or one per output channel)."""
    q = {**view.attrs["quant"], "w_zero_point": list(zero_points)}
    dtypes = (view.input_dtypes[0], str(w.dtype)[6:], *view.input_dtypes[2:])
    return LayerView(**{**view.__dict__, "attrs": {**view.attrs, "quant": q}, "input_dtypes": dtypes,
                        "const_inputs": {**view.const_inputs, 1: w}})


ZERO_POINT_CASES = {
    # name: (op, weight dtype, zero points: "tensor" (one) or "channel", x (dtype, zp, scale), y)
    "matmul_s8_one_zp_s8_in": ("QMatMul", "int8", "tensor", ("int8", -13, 0.05), ("int8", -1, 0.4)),
    "gemm_u8_per_channel": ("QGemm", "uint8", "channel", ("uint8", 7, 0.02), ("uint8", 128, 0.4)),
    "matmul_u8_fp32_out": ("QMatMul", "uint8", "tensor", ("uint8", 200, 0.02), None),
    "conv3x3_s8_per_channel": ("QConv", "int8", "channel", ("uint8", 9, 0.02), ("uint8", 128, 0.4)),
    "conv1x1_u8_s8_in": ("QConv", "uint8", "tensor", ("int8", 4, 0.03), ("int8", -2, 0.4)),
}


def int8_case(op, case, x, y, g):
    """(view, input shape, VNNI tactic) of a test case's INT8 layer: a convolution of 40 channels (3x3 padded where
    `case` says "3x3", else 1x1) on (2, 13, 7, 6), or a linear layer of 70 columns on k = 75 (no multiple of 4, nor
    of 64); random s8 weights from `g`."""
    if op == "QConv":
        kh = 3 if "3x3" in case else 1
        x_shape, cout = (2, 13, 7, 6), 40
        w = torch.randint(-127, 128, (cout, 13, kh, kh), generator=g, dtype=torch.int8)
        view = qconv_view(x_shape, w, quant(cout, x, y), (1, 1, 1, 1) if kh == 3 else (0, 0, 0, 0))
        return view, x_shape, QConvDirectTactic() if kh == 3 else QConvGemmTactic()
    x_shape = (3, 11, 75) if op == "QMatMul" else (11, 75)
    return linear_case(op, x_shape, int(op == "QGemm"), x, y)[0], x_shape, QLinearGemmTactic()


def zero_point_case(case):
    """(view, quantized input, VNNI tactic) of ZERO_POINT_CASES[case]."""
    op, w_dtype, zps, xq, yq = ZERO_POINT_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    view, x_shape, tactic = int8_case(op, case, xq, yq, g)
    cout = len(view.attrs["quant"]["w_scale"])
    w = rand_q(tuple(view.const_inputs[1].shape), w_dtype, g)
    lo, hi = RANGES[w_dtype]
    zero_points = torch.randint(lo + 20, hi - 19, (cout if zps == "channel" else 1,), generator=g).tolist()
    return with_weight_zero_points(view, w, zero_points), rand_q(x_shape, xq[0], g), tactic


@needs_vnni
@pytest.mark.parametrize("case", list(ZERO_POINT_CASES))
def test_weights_with_zero_points_match_the_formula_where_onednn_declines(case):
    """Asymmetric s8 and u8 weights (onnxruntime's quantize_static gives them to a MatMul whose weights the graph
    computes): the kernels take w_zp * (the row's byte sum) off; oneDNN takes none."""
    view, x, tactic = zero_point_case(case)
    assert tactic.supports(view)
    assert not (OneDnnInt8ConvTactic() if view.op_type == "QConv" else OneDnnInt8LinearTactic()).supports(view)
    got = run(tactic, view, [x, None, None])
    want = conv_formula(view, x) if view.op_type == "QConv" else linear_formula(view, x)
    if ZERO_POINT_CASES[case][-1] is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert_spread(got)
        assert_requantized_equal(got, want)


def test_weights_pack_as_quads_in_32_column_panels():
    k, n = 6, 40                                            # a partial quad and a partial second panel
    w = (torch.arange(k * n) % 251 - 125).to(torch.int8).reshape(k, n)
    packed = pack_quads(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 2, 32, 4)
    for row, col in ((0, 0), (5, 31), (3, 32), (4, 39)):
        assert packed[col // 32, row // 4, col % 32, row % 4] == w[row, col]
    assert packed[:, 1, :, 2:].abs().sum() == 0             # rows 6 and 7 of the padded k
    assert packed[1, :, 8:, :].abs().sum() == 0             # columns past n
    segments = pack_segments(torch.ones((3, 5, 2), dtype=torch.int8))   # each kernel row padded to 8 bytes
    assert segments.shape == (1, 6, 32, 4) and segments.sum() == 3 * 5 * 2
    assert segments[0, 1, :2, 1:].sum() == 0 and segments[0, 2, :2, 0].sum() == 2


def test_int8_kernels_decline_what_they_cannot_run():
    w = torch.randint(-127, 128, (8, 8, 3, 3), dtype=torch.int8)
    q = quant(8)
    cases = {"grouped": qconv_view((1, 8, 6, 6), w[:, :4], q, group=2),
             "dilated": qconv_view((1, 8, 6, 6), w, q, dilation=2),
             "erf": qconv_view((1, 8, 6, 6), w, q, act={"op": "Erf", "attrs": {}}),
             "residual of another type": LayerView(**{**qconv_view((1, 8, 6, 6), w, q, residual=True).__dict__,
                                                      "input_dtypes": ("uint8", "int8", "float32", "int8")})}
    for name, view in cases.items():
        assert not QConvDirectTactic().supports(view), name
        assert not QConvGemmTactic().supports(view), name
    long_k = 65_800                                          # 255 * 128 * k could overflow the int32 sums
    w = torch.zeros((long_k, 4), dtype=torch.int8)
    assert not QLinearGemmTactic().supports(linear_view("QMatMul", (1, long_k), w, quant(4, axis=1)))
    assert QLinearGemmTactic().supports(linear_view("QMatMul", (1, 4096), w[:4096], quant(4, axis=1))) or \
        not (hardware.has_any(VNNI_ISA) and native.available())
    def with_zero_points(k, zero_points):   # 255 * 255 * k must fit in int32 for weights with zero points
        return linear_view("QMatMul", (1, k), w[:k], {**quant(4, axis=1), "w_zero_point": zero_points})
    assert not QLinearGemmTactic().supports(with_zero_points(33_100, [1, 0, 0, 0]))
    vnni = hardware.has_any(VNNI_ISA) and native.available()
    assert QLinearGemmTactic().supports(with_zero_points(33_025, [1, 0, 0, 0])) or not vnni
    assert QLinearGemmTactic().supports(with_zero_points(33_100, [0, 0, 0, 0])) or not vnni
    rows = linear_view("QMatMul", (1, 8), w[:8], {**quant(1, axis=0), "w_zero_point": [1] * 8})
    assert not QLinearGemmTactic().supports(rows)   # zero points per row of the weights: not per output channel


def resnet_like() -> nn.Module:
    """A stem (7x7 stride 2, 3 input channels), bottleneck blocks with 1x1, strided 1x1 and 3x3 convolutions and
    residual adds, and a classifier: every kind of layer the INT8 kernels take."""
    from tests.models.nets import Bottleneck, ResNet

    torch.manual_seed(0)
    model = ResNet(Bottleneck, [1, 1, 0, 0], num_classes=10)
    model.layer3, model.layer4 = nn.Identity(), nn.Identity()
    model.fc = nn.Linear(512, 10)
    with torch.no_grad():
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


def quantize_static_export(model, folder, shape=(1, 3, 32, 32)) -> str:
    """`model` exported (legacy) and quantized by onnxruntime's quantize_static: QDQ, u8 activations, s8 weights per
    channel, calibrated on 4 random batches; the Q/DQ model's path."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from tests.models.nets import export
    from tests.precision.test_qdq import calibration_reader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(model, torch.randn(*shape), folder / "fp32.onnx", "legacy")
    quant_pre_process(str(folder / "fp32.onnx"), str(folder / "pre.onnx"))
    quantize_static(str(folder / "pre.onnx"), str(folder / "qdq.onnx"), calibration_reader("input", shape, 4),
                    quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return str(folder / "qdq.onnx")


@pytest.fixture(scope="module")
def qdq_resnet_like(tmp_path_factory):
    return quantize_static_export(resnet_like(), tmp_path_factory.mktemp("qgemm"))


@needs_vnni
def test_quantize_static_resnet_runs_on_kilns_int8_kernels_and_matches_onnxruntime(qdq_resnet_like, tmp_path,
                                                                                   monkeypatch):
    # kiln's kernels only: with torch's too, its reference QConv/QGemm (dequantize, FP32, quantize) races them on one
    # timed call each. Where AMX-INT8 is usable, the AMX siblings race the VNNI kernels and either may win: the
    # assertions below count an AMX kernel as the VNNI kernel of its kind.
    engine = kiln.build(qdq_resnet_like, tactic_sources="kiln", avg_timing=1, min_timing=1)
    x = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
    got, want = engine.run({"input": x})["output"], run_ort(qdq_resnet_like, {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()
    layers = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    quantized = [l for l in engine.plan.layers if l.op_type in ("QConv", "QGemm", "QMatMul")]
    assert len([l for l in quantized if l.op_type == "QConv"]) == 9
    kind = {name.replace("_int8", "_amx_int8"): name for name in QTACTICS} | {name: name for name in QTACTICS}
    for layer in quantized:
        info = layers[layer.name]
        assert info["TacticName"] in kind, (layer.name, info["TacticName"])
        assert info["RequestedPrecision"] == info["GrantedPrecision"] == "INT8"
    assert {kind[layers[l.name]["TacticName"]] for l in quantized} == set(QTACTICS)   # every kind of layer
    assert sum(len(l.inputs) > 1 for l in quantized if l.op_type == "QConv") == 2   # the residual adds fused
    engine.save(tmp_path / "model.kiln")
    np.testing.assert_array_equal(kiln.load(tmp_path / "model.kiln").run({"input": x})["output"], got)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))   # a CPU without VNNI
    elsewhere = kiln.load(tmp_path / "model.kiln", allow_other_device=True).run({"input": x})["output"]
    assert cosine(elsewhere, want) >= 0.999 and elsewhere.argmax() == want.argmax()    # on the reference kernels


def test_registry_times_kilns_int8_kernels_after_onednns():
    from kiln.tactics.registry import REGISTRY

    amx = [name.replace("_int8", "_amx_int8") for name in QTACTICS]
    assert [t.name for t in REGISTRY["QConv"]] == ["onednn.qconv2d_primitive", "onednn.qconv2d_nhwc_prepacked",
                                                   "onednn.qconv1d_prepacked",
                                                   *QTACTICS[:2], *amx[:2], "kiln.qconv2d_depthwise_nhwc_int8"]
    assert [t.name for t in REGISTRY["QGemm"]] == ["onednn.qlinear_primitive", "onednn.qlinear_prepacked",
                                                   QTACTICS[2], amx[2]]
