"""kiln's INT8 kernels on oneDNN (VNNI/AMX-INT8): quantized convolution and inner product against the formula
they implement (dequantize, FP32 op, sum, activation, requantize), within one step of the output scale."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.tactics.base import LayerView
from kiln.tactics import onednn_prim
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, OneDnnInt8LinearTactic, int8_available
from kiln.tactics.onednn_prim import PrimitiveInt8ConvTactic
from kiln.tactics.onednn_prim_linear import PrimitiveInt8LinearTactic
from kiln.tactics.reference import ReferenceTactic

needs_int8 = pytest.mark.skipif(not int8_available(), reason="this CPU has no VNNI or AMX-INT8: oneDNN's INT8 "
                                "kernels are not offered (its vpmaddubsw path saturates)")


@pytest.fixture(params=["torch", "primitive"])
def conv_tactic(request):
    """Both INT8 convolutions on oneDNN: through torch's ops, and kiln's own primitive (oneDNN's C API)."""
    if request.param == "primitive" and not onednn_prim.available():
        pytest.skip("oneDNN's C API (pip install onednn-cpu-gomp onednn-devel-cpu-gomp) is not installed here")
    return OneDnnInt8ConvTactic() if request.param == "torch" else PrimitiveInt8ConvTactic()


def quant(x_scale=0.02, x_zp=3, w_scale=(0.004,), y=(0.05, 5, "uint8"), r=None, x_dtype="uint8"):
    q = {"x_scale": x_scale, "x_zero_point": x_zp, "x_dtype": x_dtype, "w_scale": list(w_scale),
         "w_zero_point": [0] * len(w_scale), "w_axis": 0}
    if y:
        q.update(y_scale=y[0], y_zero_point=y[1], y_dtype=y[2])
    if r:
        q.update(r_scale=r[0], r_zero_point=r[1])
    return q


def conv_view(x_shape, w, pads=(1, 1, 1, 1), stride=1, group=1, q=None, bias=True, act=None, residual=None):
    k = w.shape[0]
    rng = torch.Generator().manual_seed(5)
    consts = {1: w, **({2: torch.randn(k, generator=rng)} if bias else {})}
    attrs = {"pads": list(pads), "strides": [stride] * 2, "dilations": [1, 1], "group": group,
             "kernel_shape": list(w.shape[2:]), "quant": q or quant(w_scale=[0.004 + 0.001 * i for i in range(k)]),
             **({"activation": {"op": act, "attrs": {}}} if act else {})}
    shapes = [x_shape, tuple(w.shape), (k,) if bias else None] + ([residual] if residual else [])
    dtypes = [attrs["quant"]["x_dtype"], "int8", "float32" if bias else None] + (["uint8"] if residual else [])
    out = "float32" if "y_scale" not in attrs["quant"] else attrs["quant"]["y_dtype"]
    return LayerView("QConv", "kiln", attrs, tuple(shapes), tuple(dtypes), consts, (out,))


def formula(view: LayerView, x: torch.Tensor, residual=None) -> torch.Tensor:
    """Dequantize, FP32 convolution, + dequantized residual, activation, requantize (or FP32 out)."""
    q, a = view.attrs["quant"], view.attrs
    w = view.const_inputs[1].float() * torch.tensor(q["w_scale"]).view(-1, 1, 1, 1)
    xf = (x.float() - q["x_zero_point"]) * q["x_scale"]
    pads = a["pads"]
    xf = F.pad(xf, [pads[1], pads[3], pads[0], pads[2]])
    y = F.conv2d(xf, w, view.const_inputs.get(2), a["strides"], 0, 1, a["group"])
    if residual is not None:
        y = y + (residual.float() - q["r_zero_point"]) * q["r_scale"]
    if a.get("activation"):
        y = torch.relu(y)
    if "y_scale" not in q:
        return y
    lo, hi = (0, 255) if q["y_dtype"] == "uint8" else (-128, 127)
    return torch.clamp(torch.round(y / q["y_scale"]) + q["y_zero_point"], lo, hi)


def run(tactic, view, xs):
    return tactic.prepare(view)(xs)[0]


def close_quantized(got: torch.Tensor, want: torch.Tensor):
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 1, diff.max()                   # rounding of the last step only
    assert (diff == 0).float().mean() >= 0.97


@needs_int8
@pytest.mark.parametrize("case", ["3x3", "stride2_asym_pad", "depthwise", "relu", "int8_out", "1x1", "s8_in",
                                  "s8_in_asym_pad", "zero_points_0", "zero_points_0_relu"])
def test_quantized_conv_matches_its_formula(case, conv_tactic):
    """Zero points of 0 (a ReLU's u8 output, quantize_static's usual case) are no oneDNN attribute at all in the
    primitive: its kernels take a slower compensating path for any source zero point."""
    g = torch.Generator().manual_seed(0)
    c, k = (16, 16) if case == "depthwise" else (24, 32)
    kh = 1 if case == "1x1" else 3
    w = torch.randint(-127, 128, (k, 1 if case == "depthwise" else c, kh, kh), generator=g, dtype=torch.int8)
    signed = case.startswith("s8_in")   # kiln's calibration writes symmetric s8 activations
    x = torch.randint(-128 if signed else 0, 128 if signed else 256, (1, c, 13, 11), generator=g,
                      dtype=torch.int8 if signed else torch.uint8)
    pads = {"stride2_asym_pad": (0, 1, 1, 2), "s8_in_asym_pad": (0, 1, 1, 2), "1x1": (0, 0, 0, 0)}.get(case, (1,) * 4)
    q = quant(w_scale=[0.003 + 0.0005 * i for i in range(k)], y=(0.04, -3, "int8") if case in ("int8_out", "s8_in")
              else (0.05, 0 if case.startswith("zero_points") else 5, "uint8"), x_dtype="int8" if signed else "uint8",
              x_zp=-2 if signed else 0 if case.startswith("zero_points") else 3)
    view = conv_view(tuple(x.shape), w, pads, 2 if case == "stride2_asym_pad" else 1, c if case == "depthwise" else 1,
                     q, act="Relu" if case.endswith("relu") else None)
    tactic = conv_tactic
    assert tactic.supports(view)
    got = run(tactic, view, [x, None, None])
    assert got.dtype == (torch.int8 if case in ("int8_out", "s8_in") else torch.uint8)
    close_quantized(got, formula(view, x))
    close_quantized(got, run(ReferenceTactic(), view, [x, None, None]))


@needs_int8
@pytest.mark.parametrize("case", ["k3_pad", "stride2_asym_dilated", "grouped_relu", "residual"])
def test_a_1d_quantized_conv_equals_the_reference(case):
    """Whisper's and wav2vec2's INT8 front-end convolutions ([N, C, L]) on oneDNN's 2-D kernel over [N, C, 1, L]:
    padding, stride, dilation, groups, ReLU and an INT8 residual carried to the added axis; row-major in and out."""
    from kiln.tactics.onednn_int8 import OneDnnInt8Conv1dTactic

    g = torch.Generator().manual_seed(4)
    c, k, group = 16, 24, 4 if case == "grouped_relu" else 1
    w = torch.randint(-127, 128, (k, c // group, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (2, c, 37), generator=g, dtype=torch.uint8)
    pads, stride, dilation = ((0, 2), 2, 2) if case == "stride2_asym_dilated" else ((1, 1), 1, 1)
    out_len = (37 + sum(pads) - dilation * 2 - 1) // stride + 1
    r = torch.randint(0, 256, (2, k, out_len), generator=g, dtype=torch.uint8) if case == "residual" else None
    q = quant(w_scale=[0.003 + 0.0005 * i for i in range(k)], r=(0.03, 7) if r is not None else None)
    view = conv_view(tuple(x.shape), w, pads, group=group, q=q, act="Relu" if case != "k3_pad" else None,
                     residual=tuple(r.shape) if r is not None else None)
    view = LayerView(**{**view.__dict__, "attrs": {**view.attrs, "strides": [stride], "dilations": [dilation],
                                                   "kernel_shape": [3]}})
    tactic = OneDnnInt8Conv1dTactic()
    assert tactic.supports(view) and not OneDnnInt8ConvTactic().supports(view)
    xs = [x, None, None] + ([r] if r is not None else [])
    got = run(tactic, view, xs)
    assert got.dtype == torch.uint8 and got.shape == (2, k, out_len) and got.is_contiguous()
    q = view.attrs["quant"]   # the formula: dequantize, conv1d, + dequantized residual, ReLU, requantize
    wf = w.float() * torch.tensor(q["w_scale"]).view(-1, 1, 1)
    y = F.conv1d(F.pad((x.float() - q["x_zero_point"]) * q["x_scale"], list(pads)), wf, view.const_inputs[2],
                 stride, 0, dilation, group)
    if r is not None:
        y = y + (r.float() - q["r_zero_point"]) * q["r_scale"]
    y = torch.relu(y) if case != "k3_pad" else y
    close_quantized(got, torch.clamp(torch.round(y / q["y_scale"]) + q["y_zero_point"], 0, 255).to(torch.uint8))
    close_quantized(got, run(ReferenceTactic(), view, xs))


@needs_int8
def test_int8_in_fp32_out_conv_writes_fp32(conv_tactic):
    """The classic i8f32 convolution (no QuantizeLinear after it): dequantized exactly, no requantization."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (12, 8, 3, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (1, 8, 9, 9), generator=g, dtype=torch.uint8)
    view = conv_view(tuple(x.shape), w, q=quant(w_scale=[0.002] * 12, y=None))
    got = run(conv_tactic, view, [x, None, None])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, formula(view, x), rtol=1e-4, atol=1e-4)


@needs_int8
def test_residual_sum_and_relu_fuse_into_the_conv_and_the_residual_buffer_may_be_reused(conv_tactic):
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (16, 16, 3, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (1, 16, 10, 10), generator=g, dtype=torch.uint8)
    r = torch.randint(0, 256, (1, 16, 10, 10), generator=g, dtype=torch.uint8)
    view = conv_view(tuple(x.shape), w, q=quant(w_scale=[0.003] * 16, r=(0.03, 7)), act="Relu",
                     residual=tuple(r.shape))
    kernel = conv_tactic.prepare(view)
    want = formula(view, x, r)
    kept = r.clone()
    close_quantized(kernel([x, None, None, r])[0], want)
    assert torch.equal(r, kept)                            # the plain call leaves a live residual alone
    index, into = kernel.into_input
    assert index == 3
    dead = r.clone().contiguous(memory_format=torch.channels_last)
    out = into([x, None, None, dead])[0]
    close_quantized(out, want)
    assert torch.equal(out, dead)                          # accumulated in the dead residual's buffer, no clone
    close_quantized(run(ReferenceTactic(), view, [x, None, None, r]), want)


def test_reference_kernel_sums_the_dequantized_residual_on_any_cpu():
    """The fused INT8 residual's reference (every CPU, VNNI or not) follows the same formula."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (8, 8, 3, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (1, 8, 6, 6), generator=g, dtype=torch.uint8)
    r = torch.randint(0, 256, (1, 8, 6, 6), generator=g, dtype=torch.uint8)
    view = conv_view(tuple(x.shape), w, q=quant(w_scale=[0.003] * 8, r=(0.03, 7)), act="Relu",
                     residual=tuple(r.shape))
    close_quantized(run(ReferenceTactic(), view, [x, None, None, r]), formula(view, x, r))


def linear_view(op, x_shape, w, trans_b=0, y=(0.05, 5, "uint8"), bias=True, x_dtype="uint8"):
    n = w.shape[0] if trans_b else w.shape[1]
    q = quant(w_scale=[0.002 + 0.0001 * i for i in range(n)], y=y, x_dtype=x_dtype, x_zp=0 if x_dtype == "int8" else 3)
    q["w_axis"] = 0 if trans_b else 1
    consts = {1: w, **({2: torch.linspace(-1, 1, n)} if bias else {})}
    attrs = {"quant": q, **({"transB": trans_b} if op == "QGemm" else {})}
    shapes = (x_shape, tuple(w.shape)) + (((n,),) if bias else ())
    out = y[2] if y else "float32"
    return LayerView(op, "kiln", attrs, shapes, (x_dtype, "int8") + (("float32",) if bias else ()), consts, (out,))


def linear_formula(view, x):
    q = view.attrs["quant"]
    w = view.const_inputs[1].float()
    w = w.t() if view.attrs.get("transB", 0) else w                         # [K, N]
    y = ((x.float() - q["x_zero_point"]) * q["x_scale"]) @ (w * torch.tensor(q["w_scale"]))
    if 2 in view.const_inputs:
        y = y + view.const_inputs[2]
    if "y_scale" not in q:
        return y
    lo, hi = (0, 255) if q["y_dtype"] == "uint8" else (-128, 127)
    return torch.clamp(torch.round(y / q["y_scale"]) + q["y_zero_point"], lo, hi)


@pytest.fixture(params=["torch", "primitive"])
def linear_tactic(request):
    """Both INT8 linear kernels on oneDNN: through torch's ops, and kiln's own matmul primitive."""
    if request.param == "primitive" and not onednn_prim.available():
        pytest.skip("oneDNN's C API (pip install onednn-cpu-gomp onednn-devel-cpu-gomp) is not installed here")
    return OneDnnInt8LinearTactic() if request.param == "torch" else PrimitiveInt8LinearTactic()


@needs_int8
@pytest.mark.parametrize("op,x_shape,trans_b,y", [("QGemm", (4, 64), 1, (0.05, 5, "uint8")),
                                                 ("QGemm", (1, 512), 0, (0.05, 5, "uint8")),
                                                 ("QMatMul", (1, 7, 48), 0, (0.05, 5, "uint8")),
                                                 ("QMatMul", (2, 48), 0, None),
                                                 ("QMatMul", (3, 5, 48), 0, (0.04, -3, "int8")),
                                                 ("QGemm", (4, 64), 1, (0.05, 0, "uint8"))])
@pytest.mark.parametrize("x_dtype", ["uint8", "int8"])
def test_quantized_linear_matches_its_formula(op, x_shape, trans_b, y, x_dtype, linear_tactic):
    g = torch.Generator().manual_seed(4)
    k, n = x_shape[-1], 40
    w = torch.randint(-127, 128, (n, k) if trans_b else (k, n), generator=g, dtype=torch.int8)
    signed = x_dtype == "int8"   # kiln's calibration writes symmetric s8 activations
    x = torch.randint(-128 if signed else 0, 128 if signed else 256, x_shape, generator=g,
                      dtype=torch.int8 if signed else torch.uint8)
    view = linear_view(op, x_shape, w, trans_b, y, bias=op == "QGemm", x_dtype=x_dtype)
    tactic = linear_tactic
    assert tactic.supports(view)
    got = run(tactic, view, [x, None, None])
    assert got.shape == (*x_shape[:-1], n)
    want = linear_formula(view, x)
    if y is None:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        close_quantized(got, want)


def test_int8_kernels_decline_what_onednn_cannot_run(monkeypatch):
    monkeypatch.setattr("kiln.tactics.onednn_int8.int8_available", lambda: True)   # judge the layer, not this CPU
    w = torch.randint(-127, 128, (8, 8, 3, 3), dtype=torch.int8)
    mislabelled = conv_view((1, 8, 6, 6), w, q={**quant(w_scale=[0.003] * 8), "x_dtype": "int8"})
    mislabelled = LayerView(**{**mislabelled.__dict__, "input_dtypes": ("uint8", "int8", "float32")})
    asymmetric_w = conv_view((1, 8, 6, 6), w, q={**quant(w_scale=[0.003] * 8), "w_zero_point": [1] * 8})
    unfusable_act = conv_view((1, 8, 6, 6), w, act="Erf")
    tactic = OneDnnInt8ConvTactic()
    for view in (mislabelled, asymmetric_w, unfusable_act):
        assert not tactic.supports(view)
    # oneDNN has GELU and Sigmoid post-ops, but torch's INT8 convolution raises "unsupported post op" for them
    for act in ("Gelu", "Sigmoid", "Tanh", "LeakyRelu"):
        assert not tactic.supports(conv_view((1, 8, 6, 6), w, act=act)), act
    assert tactic.supports(conv_view((1, 8, 6, 6), w, act="Swish"))
    from kiln.tactics.onednn_int8 import OneDnnInt8Conv1dTactic

    assert not OneDnnInt8Conv1dTactic().supports(conv_view((1, 8, 6, 6), w))   # 2-D: the tactic above takes it
