"""The activations gemm.h's epilogue applies as it stores (kiln.tactics.gemm_c.gemm_activation): ReLU, Clip with any
bounds, Swish, GELU, HardSwish and HardSigmoid (its alpha and beta) on kiln's 1x1, direct and linear GEMMs, FP32,
BF16 (vdpbf16ps) and AMX (real or emulated): each against the float64 formula, with no pass after the kernel (a
MobileNetV3's HardSwish expansions and HardSigmoid gates, a MobileNetV2's ReLU6 had one each); an activation the
epilogue has not is still applied after it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import hardware, native
from kiln.tactics import gemm_c
from kiln.tactics.base import LayerView
from kiln.tactics.conv1x1 import Conv1x1GemmTactic
from kiln.tactics.conv_direct import DirectConvTactic
from kiln.tactics.gemm_amx import Conv1x1GemmAmxTactic, DirectConvAmxTactic, MatMulGemmAmxTactic
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, Conv1x1GemmBf16Tactic, DirectConvBf16Tactic, MatMulGemmBf16Tactic
from kiln.tactics.matmul_c import MatMulGemmTactic
from tests.tactics.amx import amx_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

SPECS = {
    "relu6": {"op": "Clip", "attrs": {"min": 0.0, "max": 6.0}},
    "clip": {"op": "Clip", "attrs": {"min": -0.5, "max": 0.75}},
    "clip-max-only": {"op": "Clip", "attrs": {"max": 1.0}},
    "clip-inverted": {"op": "Clip", "attrs": {"min": 1.0, "max": -1.0}},   # min > max: every value is max
    "hardswish": {"op": "HardSwish", "attrs": {}},
    "hardsigmoid-torch": {"op": "HardSigmoid", "attrs": {"alpha": 1 / 6, "beta": 0.5}},
    "hardsigmoid-onnx": {"op": "HardSigmoid", "attrs": {}},                 # ONNX's defaults: alpha 0.2, beta 0.5
    "relu": {"op": "Relu", "attrs": {}},
    "gelu": {"op": "Gelu", "attrs": {}},
    "sigmoid": {"op": "Sigmoid", "attrs": {}},
    "tanh": {"op": "Tanh", "attrs": {}},
}


def formula(spec: dict, y: torch.Tensor) -> torch.Tensor:
    """What the activation computes, in float64, as ONNX defines it."""
    a = spec["attrs"]
    return {"Clip": lambda: y.clamp_min(a.get("min", -torch.inf)).clamp_max(a.get("max", torch.inf)),
            "HardSwish": lambda: y * (y / 6 + 0.5).clamp(0, 1),
            "HardSigmoid": lambda: (a.get("alpha", 0.2) * y + a.get("beta", 0.5)).clamp(0, 1),
            "Relu": lambda: y.relu(),
            "Gelu": lambda: F.gelu(y), "Sigmoid": lambda: y.sigmoid(), "Tanh": lambda: y.tanh()}[spec["op"]]()


def conv_layer(spec: dict, kernel: int, c=24, cout=40, hw=9, residual=True) -> LayerView:
    g = torch.Generator().manual_seed(kernel)
    pad = kernel // 2
    consts = {1: torch.randn(cout, c, kernel, kernel, generator=g) * 2 / (c * kernel),
              2: torch.randn(cout, generator=g)}
    shapes = ((1, c, hw, hw), (cout, c, kernel, kernel), (cout,)) + (((1, cout, hw, hw),) if residual else ())
    attrs = {"kernel_shape": [kernel] * 2, "pads": [pad] * 4, "strides": [1, 1], "dilations": [1, 1], "group": 1,
             "activation": spec}
    return LayerView("Conv", "", attrs, shapes, ("float32",) * len(shapes), consts, ("float32",), 17,
                     ((),) * len(shapes))


def linear_layer(spec: dict, k=40, n=37) -> LayerView:
    g = torch.Generator().manual_seed(n)
    consts = {1: torch.randn(k, n, generator=g) / k ** 0.5, 2: torch.randn(n, generator=g)}
    return LayerView("MatMul", "", {"activation": spec}, ((3, 11, k), (k, n), (n,)), ("float32",) * 3, consts,
                     ("float32",), 17, ((), (), ()))


def inputs(layer: LayerView) -> list:
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(layer.input_shapes[0], generator=g) * 3, None, None]
    if len(layer.input_shapes) > 3:
        xs.append(torch.randn(layer.input_shapes[3], generator=g))
    return [x.contiguous(memory_format=torch.channels_last) if x is not None and x.dim() == 4 else x for x in xs]


def expected(layer: LayerView, xs: list, rounded: bool) -> torch.Tensor:
    """The layer's float64 result; `rounded`: its input and weights rounded to bf16 first, as the BF16 GEMMs read
    them (their sums and epilogue stay FP32)."""
    cast = (lambda t: t.bfloat16().double()) if rounded else (lambda t: t.double())
    w, bias = cast(layer.const_inputs[1]), layer.const_inputs[2].double()
    if layer.op_type == "Conv":
        y = F.conv2d(cast(xs[0]), w, bias, padding=layer.attrs["pads"][0])
    else:
        y = cast(xs[0]) @ w + bias
    if len(xs) > 3:
        y = y + xs[3].double()
    return formula(layer.attrs["activation"], y)


def no_pass_after(monkeypatch):
    """Fails the test if a kernel applies its activation after the GEMM instead of in its store."""
    def refuse(spec, x):
        raise AssertionError(f"{spec['op']} applied after the kernel")
    monkeypatch.setattr(gemm_c, "apply_activation", refuse)


FP32 = [(Conv1x1GemmTactic, 1), (DirectConvTactic, 3), (MatMulGemmTactic, 0)]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("tactic,kernel", FP32, ids=["conv1x1", "direct3x3", "matmul"])
def test_fp32_gemms_apply_the_activation_as_they_store(tactic, kernel, name, monkeypatch):
    spec = SPECS[name]
    layer = linear_layer(spec) if kernel == 0 else conv_layer(spec, kernel)
    assert gemm_c.gemm_activation(spec) is not None and tactic().supports(layer)
    no_pass_after(monkeypatch)
    xs = inputs(layer)
    got = tactic().prepare(layer)(xs)[0]
    want = expected(layer, xs, rounded=False)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


BF16 = [(Conv1x1GemmBf16Tactic, Conv1x1GemmAmxTactic, 1), (DirectConvBf16Tactic, DirectConvAmxTactic, 3),
        (MatMulGemmBf16Tactic, MatMulGemmAmxTactic, 0)]


@pytest.mark.skipif(not hardware.has_any(BF16_DOT_ISA), reason="this CPU has no AVX512-BF16: kiln's BF16 GEMMs and "
                    "their AMX emulation are not compiled here")
@pytest.mark.parametrize("name", ["relu6", "hardswish", "hardsigmoid-torch", "clip", "sigmoid", "tanh"])
@pytest.mark.parametrize("kind", ["vdpbf16ps", "amx"])
@pytest.mark.parametrize("tactics", BF16, ids=["conv1x1", "direct3x3", "matmul"])
def test_bf16_and_amx_gemms_apply_the_activation_as_they_store(tactics, kind, name, request, monkeypatch):
    vdpbf16ps, amx, kernel = tactics
    if kind == "amx":
        request.getfixturevalue("amx_kernels")
    tactic = amx() if kind == "amx" else vdpbf16ps()
    spec = SPECS[name]
    layer = linear_layer(spec) if kernel == 0 else conv_layer(spec, kernel)
    no_pass_after(monkeypatch)
    xs = inputs(layer)
    got = tactic.prepare(layer)(xs)[0]
    torch.testing.assert_close(got.double(), expected(layer, xs, rounded=True), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["clip", "relu6", "relu", "hardswish", "hardsigmoid-torch", "sigmoid", "tanh"])
def test_nan_stays_nan_through_the_activation(name):
    """ONNX's Clip, Relu, HardSwish and HardSigmoid keep NaN (as torch's do, and Winograd's and the depthwise
    kernel's stores); before the Act the GEMM's ReLU turned it into 0."""
    nan_row = torch.full((1, 1, 40), float("nan"))
    out = MatMulGemmTactic().prepare(linear_layer(SPECS[name]))([nan_row, None, None])[0]
    assert out.isnan().all(), (name, out)


@pytest.mark.parametrize("spec", [{"op": "Elu", "attrs": {"alpha": 1.0}}, {"op": "LeakyRelu", "attrs": {"alpha": 0.1}},
                                  {"op": "Swish", "attrs": {"alpha": 1.702}}], ids=lambda s: s["op"])
def test_an_activation_the_store_has_not_runs_after_the_convolution(spec):
    assert gemm_c.gemm_activation(spec) is None
    layer = conv_layer(spec, 1)
    xs = inputs(layer)
    got = Conv1x1GemmTactic().prepare(layer)(xs)[0]
    y = F.conv2d(xs[0].double(), layer.const_inputs[1].double(), layer.const_inputs[2].double()) + xs[3].double()
    a = spec["attrs"]
    want = {"Elu": lambda: F.elu(y, a["alpha"]), "LeakyRelu": lambda: F.leaky_relu(y, a["alpha"]),
            "Swish": lambda: y * (a["alpha"] * y).sigmoid()}[spec["op"]]()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not MatMulGemmTactic().supports(linear_layer(spec))   # the linear GEMM leaves such layers to others


@pytest.mark.skipif(not hardware.has_any(("avx2",)), reason="this CPU has no AVX2")
def test_the_avx2_build_applies_the_same_activations(monkeypatch, tmp_path):
    """gemm.c compiled for AVX2 alone (a Zen 3's build: 8-float vectors) stores what this CPU's build stores."""
    from tests.tactics.avx2 import avx2_build

    avx2, built = avx2_build("gemm", tmp_path), native.library
    for name in ("relu6", "hardswish", "hardsigmoid-onnx", "clip-max-only", "sigmoid", "tanh"):
        layer = linear_layer(SPECS[name])
        xs = inputs(layer)
        here = MatMulGemmTactic().prepare(layer)(xs)[0]
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda n, generated="": avx2 if n == "gemm" else built(n, generated))
            there = MatMulGemmTactic().prepare(layer)(xs)[0]
        torch.testing.assert_close(there, here, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(here.double(), expected(layer, xs, rounded=False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["fp32", "vdpbf16ps", "amx"])
def test_conv1x1_writes_into_a_channel_slice_what_it_returns(kind, request):
    """kiln.runtime.elision's write_into: the 1x1 GEMM stores rows `ldc` apart into a channel slice of a wider
    channel-major tensor, the same bits it returns, and leaves the channels around the slice alone."""
    if kind != "fp32" and not hardware.has_any(BF16_DOT_ISA):
        pytest.skip("this CPU has no AVX512-BF16: kiln's BF16 GEMMs and their AMX emulation are not compiled here")
    if kind == "amx":
        request.getfixturevalue("amx_kernels")
    tactic = {"fp32": Conv1x1GemmTactic, "vdpbf16ps": Conv1x1GemmBf16Tactic, "amx": Conv1x1GemmAmxTactic}[kind]()
    layer = conv_layer(SPECS["hardswish"], 1, residual=False)
    kernel = tactic.prepare(layer)
    xs = inputs(layer)
    want = kernel(xs)[0]
    wide = torch.full((1, 40 + 24, 9, 9), 7.0, dtype=want.dtype).contiguous(memory_format=torch.channels_last)
    kernel.write_into(xs, wide.narrow(1, 16, 40))
    assert torch.equal(wide.narrow(1, 16, 40), want)
    assert bool((wide.narrow(1, 0, 16) == 7).all()) and bool((wide.narrow(1, 56, 8) == 7).all())
    row_major = torch.zeros(1, 80, 9, 9, dtype=want.dtype).narrow(1, 0, 40)   # not channel-major: copied
    kernel.write_into(xs, row_major)
    assert torch.equal(row_major, want)
