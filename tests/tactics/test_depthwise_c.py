"""kiln's FP32/BF16 depthwise convolution (kiln.tactics.depthwise_c): against the convolution in float64 over every
geometry the kernel splits differently (borders, stride, dilation, channel tails, batches), bf16 storage, an AVX2
build, which layers it takes, and a MobileNetV3-style network on it against onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.depthwise_c import DepthwiseConvBf16Tactic, DepthwiseConvTactic
from tests.conftest import run_ort

needs_cc = pytest.mark.skipif(not native.available(), reason="no C compiler: kiln's C kernels are unavailable")

RELU = {"op": "Relu", "attrs": {}}
CLIP6 = {"op": "Clip", "attrs": {"min": 0.0, "max": 6.0}}
SWISH = {"op": "Swish", "attrs": {"alpha": 1.0}}
HARDSWISH = {"op": "HardSwish", "attrs": {}}


def depthwise_view(x_shape, k, pads, stride=(1, 1), dilation=(1, 1), act=None, bias=True, dtype="float32",
                   multiplier=1, group=None, seed=0):
    """A depthwise Conv's LayerView: weights [c * multiplier, 1, kh, kw] (group c unless given)."""
    c = x_shape[1]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((c * multiplier, 1, *k), generator=g)
    consts = {1: w, **({2: torch.randn(c * multiplier, generator=g)} if bias else {})}
    attrs = {"pads": list(pads), "strides": list(stride), "dilations": list(dilation), "group": group or c,
             "kernel_shape": list(k), **({"activation": act} if act else {})}
    shapes = (x_shape, tuple(w.shape), *(((c * multiplier,),) if bias else ()))
    return LayerView("Conv", "", attrs, shapes, (dtype,) + ("float32",) * (len(shapes) - 1), consts, (dtype,))


def reference(view: LayerView, x: torch.Tensor) -> torch.Tensor:
    """Zero padding, the convolution and the activation in float64."""
    a, w, b = view.attrs, view.const_inputs[1].double(), view.const_inputs.get(2)
    pt, pl, pb, pr = a["pads"]
    y = F.conv2d(F.pad(x.double(), (pl, pr, pt, pb)), w, None if b is None else b.double(), a["strides"],
                 dilation=a["dilations"], groups=a["group"])
    spec = a.get("activation") or {"op": None}
    if spec["op"] == "Relu":
        return torch.relu(y)
    if spec["op"] == "Clip":
        return y.clamp(spec["attrs"]["min"], spec["attrs"]["max"])
    if spec["op"] == "Swish":
        return F.silu(y)
    if spec["op"] == "HardSwish":
        return y * (y / 6 + 0.5).clamp(0, 1)
    return y


CASES = {
    # name: (x shape, kernel, pads (top, left, bottom, right), stride, dilation, activation)
    "3x3_16_channels_relu": ((1, 16, 12, 19), (3, 3), (1, 1, 1, 1), (1, 1), (1, 1), RELU),
    "3x3_s2_72_channels_relu6": ((2, 72, 15, 14), (3, 3), (1, 1, 1, 1), (2, 2), (1, 1), CLIP6),
    "5x5_120_channels_hardswish": ((1, 120, 9, 21), (5, 5), (2, 2, 2, 2), (1, 1), (1, 1), HARDSWISH),
    "5x5_s2_asymmetric_pads_swish": ((1, 40, 13, 17), (5, 5), (1, 2, 2, 1), (2, 2), (1, 1), SWISH),
    "3x3_dilated_7_channels": ((1, 7, 10, 11), (3, 3), (2, 2, 2, 2), (1, 1), (2, 2), None),
    "7x7_map_smaller_than_its_window": ((1, 33, 4, 5), (7, 7), (3, 3, 3, 3), (1, 1), (1, 1), RELU),
    "3x5_s2x1_no_pads": ((1, 24, 9, 30), (3, 5), (0, 0, 0, 0), (2, 1), (1, 1), None),
    "3x3_960_channels_7x7": ((1, 960, 7, 7), (3, 3), (1, 1, 1, 1), (1, 1), (1, 1), HARDSWISH),
    "3x3_clip_min_over_max": ((1, 16, 6, 7), (3, 3), (1, 1, 1, 1), (1, 1), (1, 1),   # ONNX: every value is max
                              {"op": "Clip", "attrs": {"min": 0.5, "max": -0.5}}),
}


@needs_cc
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", CASES)
def test_depthwise_matches_the_convolution_in_float64(case, bias):
    x_shape, k, pads, stride, dilation, act = CASES[case]
    view = depthwise_view(x_shape, k, pads, stride, dilation, act, bias)
    assert DepthwiseConvTactic().supports(view)
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(7)).contiguous(memory_format=torch.channels_last)
    got = DepthwiseConvTactic().prepare(view)([x] + [None] * (len(view.input_shapes) - 1))[0]
    want = reference(view, x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)   # FP32 sums of at most 49 products


@pytest.mark.skipif(not (native.available() and hardware.has_any(hardware.BF16_ISA)),
                    reason="the BF16 tactics are offered only where the CPU computes BF16 natively")
@pytest.mark.parametrize("case", ["3x3_s2_72_channels_relu6", "5x5_120_channels_hardswish", "3x3_dilated_7_channels"])
def test_bf16_storage_rounds_only_the_output(case):
    """bf16 in and out, FP32 arithmetic: the output is the float64 result of the bf16 input, rounded once."""
    x_shape, k, pads, stride, dilation, act = CASES[case]
    view = depthwise_view(x_shape, k, pads, stride, dilation, act, dtype="bfloat16")
    tactic = DepthwiseConvBf16Tactic()
    assert tactic.supports(view) and not DepthwiseConvTactic().supports(view)
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = tactic.prepare(view)([x.contiguous(memory_format=torch.channels_last), None, None])[0]
    want = reference(view, x.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-4)


@needs_cc
@pytest.mark.parametrize("case", ["3x3_s2_72_channels_relu6", "5x5_s2_asymmetric_pads_swish"])
def test_an_avx2_build_gives_the_same_results(case, tmp_path, monkeypatch):
    """depthwise.c without AVX-512 (a Zen 3: 8-float vectors, AVX2 masked loads for the channel tails) compiled here
    with AVX-512 turned off, where the compiler can target it."""
    import ctypes
    from types import SimpleNamespace

    from kiln.native.compiler import CompileError, compile_unit
    from kiln.tactics import depthwise_c

    if not hardware.has_any(("avx2",)):
        pytest.skip("this CPU has no AVX2")
    try:
        compile_unit(native.toolchain(), '#include "depthwise.c"\n', tmp_path / "avx2.so", "avx2.c",
                     ("-mno-avx512f",))
    except CompileError as exc:
        pytest.skip(f"the compiler cannot target AVX2 alone here: {exc}")
    lib = ctypes.CDLL(str(tmp_path / "avx2.so"))
    lib.kiln_depthwise.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    monkeypatch.setattr(depthwise_c, "native", SimpleNamespace(library=lambda name: lib, available=lambda: True))
    x_shape, k, pads, stride, dilation, act = CASES[case]
    view = depthwise_view(x_shape, k, pads, stride, dilation, act)
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(5)).contiguous(memory_format=torch.channels_last)
    got = DepthwiseConvTactic().prepare(view)([x, None, None])[0]
    torch.testing.assert_close(got.double(), reference(view, x), rtol=1e-5, atol=1e-5)


@needs_cc
def test_only_one_channel_per_group_and_the_activations_it_applies():
    shape, pads = (1, 8, 6, 6), (1, 1, 1, 1)
    tactic = DepthwiseConvTactic()
    plain = depthwise_view(shape, (3, 3), pads)
    assert tactic.supports(plain)                                                  # the layer the others vary
    assert not tactic.supports(depthwise_view(shape, (3, 3), pads, multiplier=2))  # two output channels per group
    grouped = depthwise_view(shape, (3, 3), pads, group=4)
    assert not tactic.supports(grouped)                                            # two input channels per group
    leaky = depthwise_view(shape, (3, 3), pads, act={"op": "LeakyRelu", "attrs": {"alpha": 0.1}})
    assert not tactic.supports(leaky)                                              # an activation it has not
    assert not tactic.supports(depthwise_view(shape, (3, 3), pads, dtype="bfloat16"))   # FP32 storage only
    residual = LayerView("Conv", "", plain.attrs, (*plain.input_shapes, (1, 8, 6, 6)),
                         (*plain.input_dtypes, "float32"), plain.const_inputs, plain.output_dtypes)
    assert not tactic.supports(residual)                                           # a fused residual sum
    same = LayerView("Conv", "", {**plain.attrs, "auto_pad": "SAME_UPPER"}, plain.input_shapes, plain.input_dtypes,
                     plain.const_inputs, plain.output_dtypes)
    assert not tactic.supports(same)                                               # pads left to auto_pad


def mobilenet_v3_block() -> torch.nn.Module:
    """An inverted residual block as MobileNetV3's: 1x1 expansion, HardSwish, a 5x5 depthwise layer with HardSwish,
    squeeze-and-excitation, 1x1 projection, and a stride-2 3x3 depthwise stage with ReLU6."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.expand = nn.Sequential(nn.Conv2d(16, 72, 1), nn.Hardswish())
            self.depthwise = nn.Sequential(nn.Conv2d(72, 72, 5, padding=2, groups=72), nn.Hardswish())
            self.squeeze, self.excite = nn.Conv2d(72, 24, 1), nn.Conv2d(24, 72, 1)
            self.project = nn.Conv2d(72, 16, 1)
            self.down = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16), nn.ReLU6())

        def forward(self, x):
            y = self.depthwise(self.expand(x))
            gate = F.hardsigmoid(self.excite(torch.relu(self.squeeze(F.adaptive_avg_pool2d(y, 1)))))
            return self.down(x + self.project(y * gate))

    torch.manual_seed(0)
    return Block().eval()


@needs_cc
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_mobilenet_v3_block_runs_its_depthwise_layers_here_and_matches_onnxruntime(bf16, tmp_path):
    from tests.models.nets import export

    if bf16 and not hardware.has_any(hardware.BF16_ISA):
        pytest.skip("the BF16 tactics are offered only where the CPU computes BF16 natively")
    path = tmp_path / "block.onnx"
    export(mobilenet_v3_block(), torch.rand(1, 16, 20, 20), path, "legacy")
    # kiln's kernels only: the depthwise layers have this kernel and torch's reference to choose from
    engine = kiln.build(str(path), tactic_sources="kiln", bf16=bf16, avg_timing=1, min_timing=1,
                        **({"accuracy": "cos:0.99"} if bf16 else {}))
    x = np.random.default_rng(3).random((1, 16, 20, 20)).astype(np.float32)
    name = engine.input_names[0]
    got, want = engine.run({name: x})[engine.output_names[0]], run_ort(str(path), {name: x})[0]
    if bf16:
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # under --bf16 each layer races both kernels: the FP32 one may win with its conversions counted, and says so
    kernels = {DepthwiseConvTactic.name: "FP32", DepthwiseConvBf16Tactic.name: "BF16" if bf16 else None}
    # (a NoOp layer, an elided conversion where the timing made one, carries no TacticName, as in TensorRT)
    depthwise = [l for l in engine.layer_info()["Layers"] if l.get("TacticName") in kernels]
    assert len(depthwise) == 2
    assert all(l["GrantedPrecision"] == kernels[l["TacticName"]] for l in depthwise)
