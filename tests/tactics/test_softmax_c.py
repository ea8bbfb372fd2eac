"""kiln's Softmax and LogSoftmax in C (kiln.tactics.softmax_c) against torch in float64: every axis, both opsets'
axis rules, both layouts (the output in the input's), FP32 and bf16 storage, NaN and infinities as torch gives
them, a batch read per call; and a model with a DFL-style softmax against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.tactics import codegen
from kiln.tactics.base import ANY, HWC, LayerView
from kiln.tactics.softmax_c import SoftmaxBf16Tactic, SoftmaxTactic, reduced_axes
from tests.tactics.avx2 import avx2_build

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
bf16_cpu = pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                              reason="no native BF16 (BF16 tactics are offered only there)")
LAST = torch.channels_last
FP32_ABS = 2e-6   # Cephes' expf (~2 ulp) and a reciprocal: probabilities within this of float64's
LOG_ABS = 1e-5    # log-probabilities of magnitude up to ~30 (inputs of scale 5)


def layer(shape, op="Softmax", opset=17, in_dtype="float32", out_dtype="float32", **attrs) -> LayerView:
    return LayerView(op, "", attrs, (tuple(shape),), (in_dtype,), {}, (out_dtype,), opset, ((),))


def want(x: torch.Tensor, view: LayerView) -> torch.Tensor:
    """torch's (log-)softmax in float64 over the layer's axes (flattened for opset < 13)."""
    axes = reduced_axes(view)
    x = x.double()
    flat = x.reshape(*x.shape[:axes[0]], -1) if len(axes) > 1 else x
    fn = torch.log_softmax if view.op_type == "LogSoftmax" else torch.softmax
    return fn(flat, dim=axes[0]).reshape(x.shape)


CASES = [  # shape, opset, attrs
    ((1, 16, 4, 37), 17, {"axis": 1}),     # DFL-like: columns, a vector tail
    ((2, 5, 7, 3), 17, {"axis": 2}),
    ((3, 1000), 17, {}),                   # a classifier's rows, last axis by default
    ((4, 19), 17, {"axis": 0}),            # the batch axis: one outer block
    ((2, 3, 33), 17, {"axis": -2}),
    ((2, 3, 5, 9), 11, {}),                # opset 11: axes 1.. flattened, one row
    ((2, 3, 5, 9), 11, {"axis": 2}),
    ((6,), 17, {}),
]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,opset,attrs", CASES, ids=lambda c: str(c))
def test_fp32_equals_torch_on_every_axis(shape, opset, attrs, op):
    view = layer(shape, op, opset, **attrs)
    assert SoftmaxTactic().supports(view)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 5
    got = SoftmaxTactic().prepare(view)([x])[0]
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want(x, view), atol=LOG_ABS if op == "LogSoftmax" else FP32_ABS, rtol=0)


@pytest.mark.parametrize("opset,axis", [(17, 1), (17, 3), (11, 1), (11, 2)])
def test_channel_major_input_gives_channel_major_output(opset, axis):
    """Axis 1 of an NHWC tensor is contiguous rows, as is opset 11's flattened 1..3; axis 3 is columns there, and
    opset 11's flattened 2..3 (H and W, adjacent in NHWC) one run of H * W rows, C columns."""
    view = layer((2, 21, 6, 5), "Softmax", opset, axis=axis)
    tactic = SoftmaxTactic()
    assert tactic.input_formats(view) == [ANY] and tactic.output_format(view, [HWC]) == HWC
    x = (torch.randn(2, 21, 6, 5, generator=torch.Generator().manual_seed(3)) * 4).contiguous(memory_format=LAST)
    got = tactic.prepare(view)([x])[0]
    assert got.is_contiguous(memory_format=LAST)
    torch.testing.assert_close(got.double(), want(x, view), atol=FP32_ABS, rtol=0)


def test_a_layout_other_than_the_plans_is_copied_first():
    """A tensor in neither layout (a transposed view) is made row-major before the call."""
    view = layer((2, 3, 5, 9), axis=2)
    x = torch.randn(2, 3, 9, 5).transpose(2, 3)
    got = SoftmaxTactic().prepare(view)([x])[0]
    assert got.is_contiguous()
    torch.testing.assert_close(got.double(), want(x, view), atol=FP32_ABS, rtol=0)


@pytest.mark.parametrize("dim", [1, 2])
def test_nan_and_infinities_as_torch(dim):
    x = torch.randn(2, 5, 7)
    x[0, 1, 2] = float("nan")
    x[1, :, 3] = -float("inf")       # a column of -inf: NaN (0 / 0)
    x[1, 2, 4] = float("inf")        # +inf: NaN (inf - inf)
    x[0, :, 5] = -float("inf")
    x[0, 0, 5] = 1.0                 # one key left: probability 1
    view = layer(x.shape, axis=dim)
    got, ref = SoftmaxTactic().prepare(view)([x])[0], torch.softmax(x.double(), dim)
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got.double().nan_to_num(7.0), ref.nan_to_num(7.0), atol=FP32_ABS, rtol=0)


def test_the_batch_is_read_per_call():
    view = LayerView("Softmax", "", {"axis": 1}, ((1, 4, 3, 10),), ("float32",), {}, ("float32",), 17, ((0, 3),))
    kernel = SoftmaxTactic().prepare(view)
    for shape in [(1, 4, 3, 10), (3, 4, 3, 50), (2, 4, 3, 1)]:
        x = torch.randn(shape) * 3
        torch.testing.assert_close(kernel([x])[0].double(), want(x, view), atol=FP32_ABS, rtol=0)


@bf16_cpu
@pytest.mark.parametrize("in_dtype,out_dtype", [("bfloat16", "bfloat16"), ("bfloat16", "float32"),
                                                ("float32", "bfloat16")])
@pytest.mark.parametrize("shape,attrs", [((1, 16, 4, 37), {"axis": 1}), ((3, 250), {})])
def test_bf16_storage_computes_in_fp32(shape, attrs, in_dtype, out_dtype):
    view = layer(shape, in_dtype=in_dtype, out_dtype=out_dtype, **attrs)
    assert SoftmaxBf16Tactic().supports(view) and not SoftmaxTactic().supports(view)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 5).to(getattr(torch, in_dtype))
    got = SoftmaxBf16Tactic().prepare(view)([x])[0]
    assert got.dtype == getattr(torch, out_dtype)
    expected = want(x.float(), view)   # the bf16 input's exact values, FP32 math
    if out_dtype == "bfloat16":   # rounded once, to nearest even: within half a bf16 ulp of the exact result
        torch.testing.assert_close(got.double(), expected, atol=FP32_ABS, rtol=2 ** -8)
    else:
        torch.testing.assert_close(got.double(), expected, atol=FP32_ABS, rtol=0)


@pytest.mark.parametrize("view", [
    LayerView("Softmax", "", {"axis": 1}, ((2, 3),), ("int64",), {}, ("int64",), 17, ((),)),
    LayerView("Softmax", "", {"axis": 1}, (None,), ("float32",), {}, ("float32",), 17, ((),)),
    LayerView("Hardmax", "", {"axis": 1}, ((2, 3),), ("float32",), {}, ("float32",), 17, ((),)),
], ids=["int64", "unknown rank", "Hardmax"])
def test_declines_what_it_cannot_compute(view):
    assert not SoftmaxTactic().supports(view)


def dfl_model() -> onnx.ModelProto:
    """YOLOv8's DFL: [1, 64, A] -> [1, 4, 16, A] -> transpose -> Softmax(axis=1) -> 1x1 conv with weights 0..15,
    then a LogSoftmax over the last axis."""
    a = 336
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Softmax", ["t"], ["p"], axis=1),
             helper.make_node("Conv", ["p", "w"], ["c"]),
             helper.make_node("LogSoftmax", ["c"], ["y"], axis=-1)]
    inits = [helper.make_tensor("shape", TensorProto.INT64, [4], [1, 4, 16, a]),
             helper.make_tensor("w", TensorProto.FLOAT, [1, 16, 1, 1], list(map(float, range(16))))]
    graph = helper.make_graph(nodes, "dfl", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, a])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, a])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_dfl_model_on_kilns_kernels_matches_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = str(tmp_path / "dfl.onnx")
    onnx.save(dfl_model(), path)
    engine = kiln.build(path, tactic_sources="kiln", avg_timing=1, min_timing=1)
    softmaxes = [l for l in engine.layer_info()["Layers"] if l["LayerType"] == "SoftMax"]
    assert len(softmaxes) == 2 and {l["TacticName"] for l in softmaxes} == {"kiln.softmax"}
    x = np.random.default_rng(2).standard_normal((1, 64, 336)).astype(np.float32) * 3
    got = engine.run({"x": x})["y"]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.skipif(not hardware.has_any(("avx2",)), reason="no AVX2")
def test_the_avx2_build_matches_torch(tmp_path):
    """softmax.c compiled for AVX2 alone (-march=x86-64-v3: 8-lane vectors and tails, as on a Zen 3)."""
    lib = avx2_build("softmax", tmp_path)
    for (outer, n, inner), log in [((3, 21, 1), 0), ((2, 16, 37), 0), ((2, 5, 11), 4), ((4, 100, 1), 4)]:
        x = torch.randn(outer, n, inner) * 5
        y = torch.empty_like(x)
        lib.kiln_softmax(x.data_ptr(), y.data_ptr(), outer, n, inner, log)
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), 1)
        torch.testing.assert_close(y.double(), ref, atol=LOG_ABS if log else FP32_ABS, rtol=0)
