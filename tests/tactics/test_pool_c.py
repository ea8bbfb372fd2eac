"""kiln's NHWC pooling kernels (kiln.tactics.pool_c): equal to onnxruntime's MaxPool on every window geometry
ONNX allows (ceil mode, dilation, asymmetric pads, batches) and to torch's mean/amax for global pools, NaN
propagated like torch, and declined where they do not apply."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from kiln import hardware
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.pool_c import NhwcPoolBf16Tactic, NhwcPoolTactic
from tests.conftest import make_model, run_ort

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")


def view(op, shape, dynamic=(), outputs=("float32",), dtype="float32", **attrs):
    return LayerView(op, "", attrs, (shape,), (dtype,), {}, outputs, input_dynamic=(dynamic,))


def channels_last(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).contiguous(
        memory_format=torch.channels_last)


MAXPOOL_CASES = [  # input shape, attrs
    ((1, 64, 112, 112), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),   # ResNet's stem
    ((1, 32, 20, 20), dict(kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2])),      # YOLOv8's SPPF
    ((2, 10, 9, 7), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),              # ceil mode, odd maps
    ((1, 3, 11, 12), dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 1], pads=[2, 0, 1, 1])),
    ((1, 70, 5, 5), dict(kernel_shape=[3, 3])),                                            # no pads, 70 channels
]


@pytest.mark.parametrize("shape,attrs", MAXPOOL_CASES, ids=lambda c: str(c))
def test_maxpool_equals_onnxruntime(shape, attrs):
    layer = view("MaxPool", shape, **attrs)
    assert NhwcPoolTactic().supports(layer)
    x = channels_last(shape)
    got = NhwcPoolTactic().prepare(layer)([x])[0]
    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    want = run_ort(model, {"x": x.contiguous().numpy()})[0]
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(got.numpy(), want)   # a maximum is exact


AVGPOOL_CASES = [  # input shape, attrs (opset 19: dilations)
    ((1, 32, 20, 20), dict(kernel_shape=[2, 2], strides=[2, 2])),                            # DenseNet's transition
    ((1, 70, 9, 9), dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])),           # Inception's branch
    ((1, 70, 9, 9), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    ((2, 10, 9, 7), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1)),
    ((2, 10, 9, 7), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1, count_include_pad=1)),
    ((1, 3, 11, 12), dict(kernel_shape=[3, 2], strides=[1, 2], dilations=[2, 1], pads=[2, 0, 1, 1])),
]


@pytest.mark.parametrize("shape,attrs", AVGPOOL_CASES, ids=range(len(AVGPOOL_CASES)))
def test_average_pool_equals_onnxruntime(shape, attrs):
    """Padding counted or not, the ceil-mode overhang never; either input layout (a planar one is transposed)."""
    layer = view("AveragePool", shape, **attrs)
    assert NhwcPoolTactic().supports(layer) and NhwcPoolTactic().input_formats(layer) == ["hwc"]
    x = channels_last(shape, seed=6)
    node = helper.make_node("AveragePool", ["x"], ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=19)
    want = run_ort(model, {"x": x.contiguous().numpy()})[0]
    kernel = NhwcPoolTactic().prepare(layer)
    for given in (x, x.contiguous()):
        got = kernel([given])[0]
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not (codegen.available() and hardware.has_any(hardware.BF16_ISA)),
                    reason="no C compiler, or no native BF16 (BF16 tactics are offered only there)")
@pytest.mark.parametrize("x_dtype,y_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                             ("bfloat16", "float32")])
def test_bf16_average_pool_sums_in_fp32_and_rounds_once(x_dtype, y_dtype):
    shape, attrs = AVGPOOL_CASES[4]
    x = channels_last(shape, seed=7).to(getattr(torch, x_dtype))
    layer = LayerView("AveragePool", "", attrs, (shape,), (x_dtype,), {}, (y_dtype,), 19, ((),))
    assert NhwcPoolBf16Tactic().supports(layer)
    got = NhwcPoolBf16Tactic().prepare(layer)([x])[0]
    node = helper.make_node("AveragePool", ["x"], ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=19)
    want = torch.from_numpy(run_ort(model, {"x": x.float().contiguous().numpy()})[0])
    assert got.dtype == getattr(torch, y_dtype) and got.is_contiguous(memory_format=torch.channels_last)
    tol = 2 ** -8 if y_dtype == "bfloat16" else 1e-6   # a bf16 output: the FP32 average rounded once
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,onnx_type", [("uint8", TensorProto.UINT8), ("int8", TensorProto.INT8)])
@pytest.mark.parametrize("shape,attrs", [MAXPOOL_CASES[0], MAXPOOL_CASES[3],
                                         *(((2, c, 9, 8), MAXPOOL_CASES[1][1]) for c in (8, 16, 24, 32, 48))],
                         ids=["stem", "dilated", *(f"c{c}" for c in (8, 16, 24, 32, 48))])
def test_int8_maxpool_equals_onnxruntime(shape, attrs, dtype, onnx_type):
    """Between INT8 layers a MaxPool runs on the quantized values (Q/DQ fusion swaps it with its Q); the channel
    counts compiled with constant widths too."""
    layer = view("MaxPool", shape, outputs=(dtype,), dtype=dtype, **attrs)
    assert NhwcPoolTactic().supports(layer)
    info = torch.iinfo(getattr(torch, dtype))
    x = torch.randint(info.min, info.max + 1, shape, generator=torch.Generator().manual_seed(3),
                      dtype=getattr(torch, dtype)).contiguous(memory_format=torch.channels_last)
    got = NhwcPoolTactic().prepare(layer)([x])[0]
    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", onnx_type, list(shape))],
                       [helper.make_tensor_value_info("y", onnx_type, None)])
    want = run_ort(model, {"x": x.contiguous().numpy()})[0]
    assert got.dtype == x.dtype and got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("op,reference", [("GlobalAveragePool", lambda x: x.mean(dim=(2, 3), keepdim=True)),
                                          ("GlobalMaxPool", lambda x: x.amax(dim=(2, 3), keepdim=True))])
def test_global_pools_equal_torch(op, reference):
    shape = (2, 130, 7, 9)
    x = channels_last(shape)
    got = NhwcPoolTactic().prepare(view(op, shape))([x])[0]
    want = reference(x.double())
    assert got.shape == want.shape == (2, 130, 1, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


SPATIAL_REDUCTIONS = [  # op, attrs, const axes input (opset 18), torch reference of float64 x
    ("ReduceMean", dict(axes=[2, 3]), None, lambda x: x.mean(dim=(2, 3), keepdim=True)),
    ("ReduceMean", dict(axes=[-1, -2], keepdims=0), None, lambda x: x.mean(dim=(2, 3))),
    ("ReduceMean", {}, torch.tensor([3, 2]), lambda x: x.mean(dim=(2, 3), keepdim=True)),
    ("ReduceMax", dict(keepdims=0), torch.tensor([2, -1]), lambda x: x.amax(dim=(2, 3))),
]


@pytest.mark.parametrize("op,attrs,axes,reference", SPATIAL_REDUCTIONS, ids=range(4))
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_spatial_reductions_run_as_global_pools(op, attrs, axes, reference, layout):
    """ReduceMean/ReduceMax over H and W (the dynamo exporter's adaptive_avg_pool2d(x, 1); Keras' global pooling),
    with axes as an attribute or opset 18's input, negative or in any order, keepdims either way."""
    shape = (2, 70, 5, 6)
    consts = {} if axes is None else {1: axes}
    layer = LayerView(op, "", attrs, (shape,) + (((2,),) if consts else ()), ("float32", "int64")[:1 + len(consts)],
                      consts, ("float32",), 18, ((),) * (1 + len(consts)))
    assert NhwcPoolTactic().supports(layer)
    x = channels_last(shape, seed=4).contiguous(memory_format=layout)
    got = NhwcPoolTactic().prepare(layer)([x, None][:1 + len(consts)])[0]
    want = reference(x.double())
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,attrs", [("MaxPool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
                                      ("GlobalAveragePool", {}), ("GlobalMaxPool", {})])
def test_nan_propagates_like_torch(op, attrs):
    x = channels_last((1, 4, 6, 6))
    x[0, 1, 2, 3] = float("nan")
    got = NhwcPoolTactic().prepare(view(op, (1, 4, 6, 6), **attrs))([x])[0]
    assert bool(got[0, 1].isnan().any()) and not bool(got[0, 0].isnan().any())


@pytest.mark.parametrize("op,attrs", [("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
                                      ("GlobalAveragePool", {})])
def test_channel_planar_input_keeps_its_layout(op, attrs):
    """The tactic takes the producer's layout (no Reformat layers): NCHW in, NCHW out, same values (MaxPool between
    two transposes, the global pools on their row loop)."""
    layer = view(op, (1, 8, 10, 10), **attrs)
    assert NhwcPoolTactic().input_formats(layer) == ["any"]
    assert NhwcPoolTactic().output_format(layer, ["linear"]) == "linear"
    assert NhwcPoolTactic().output_format(layer, ["hwc"]) == "hwc"
    kernel = NhwcPoolTactic().prepare(layer)
    x = channels_last((1, 8, 10, 10))
    planar, major = kernel([x.contiguous()])[0], kernel([x])[0]
    assert planar.is_contiguous() and torch.allclose(planar, major, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer", [
    view("MaxPool", (1, 4, 8), kernel_shape=[2]),                                    # 1-D
    view("MaxPool", (1, 4, 8, 8, 8), kernel_shape=[2, 2, 2]),                        # 3-D
    view("MaxPool", (1, 4, 8, 8), outputs=("float32", "int64"), kernel_shape=[2, 2]),  # with indices
    view("MaxPool", (1, 4, 8, 8), dynamic=(2,), kernel_shape=[2, 2]),                # dynamic height
    view("MaxPool", (1, 4, 8, 8), auto_pad="SAME_UPPER", kernel_shape=[2, 2]),
    view("GlobalAveragePool", (1, 4, 8, 8), dtype="float16"),
    view("AveragePool", (1, 4, 8), kernel_shape=[2]),                               # 1-D
    view("GlobalAveragePool", (1, 4, 8, 8), outputs=("uint8",), dtype="uint8"),     # INT8 global pools: not here
    view("ReduceMean", (1, 4, 8, 8), axes=[1, 2, 3]),                                # not the spatial axes only
    view("ReduceMean", (1, 4, 8, 8), axes=[3]),
    view("ReduceMax", (4, 8, 8), axes=[1, 2]),                                       # 3-D
    view("ReduceSum", (1, 4, 8, 8), axes=[2, 3]),
    view("ReduceMean", (1, 4, 8, 8)),                                                # no axes: all of them
], ids=range(13))
def test_declines_what_it_cannot_run(layer):
    assert not NhwcPoolTactic().supports(layer)


@pytest.mark.skipif(not (codegen.available() and hardware.has_any(hardware.BF16_ISA)),
                    reason="no C compiler, or no native BF16 (BF16 tactics are offered only there)")
@pytest.mark.parametrize("x_dtype,y_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                             ("bfloat16", "float32")])
def test_bf16_maxpool_is_exact_in_every_storage_combination(x_dtype, y_dtype):
    """The maximum of bf16 values is one of them; an FP32 input rounded first gives the rounded FP32 maximum. NaN
    propagates; windows over the padding only see real pixels."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(2, 20, 11, 13, generator=g).contiguous(memory_format=torch.channels_last)
    x[0, 3, 4, 5] = float("nan")
    x = x.to(getattr(torch, x_dtype))
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}
    view = LayerView("MaxPool", "", attrs, ((2, 20, 11, 13),), (x_dtype,), {}, (y_dtype,), 17, ((),))
    tactic = NhwcPoolBf16Tactic()
    assert tactic.supports(view)
    got = tactic.prepare(view)([x])[0]
    want = torch.nn.functional.max_pool2d(x.float(), 3, 2, 1, ceil_mode=True).to(getattr(torch, y_dtype))
    assert got.dtype == want.dtype and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert got.float().isnan().sum() == want.float().isnan().sum() > 0


def test_bf16_maxpool_is_offered_on_bf16_cpus_only(monkeypatch):
    view = LayerView("MaxPool", "", {"kernel_shape": [2, 2]}, ((1, 8, 4, 4),), ("bfloat16",), {}, ("bfloat16",), 17,
                     ((),))
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    assert not NhwcPoolBf16Tactic().supports(view) and not NhwcPoolTactic().supports(view)


@pytest.mark.skipif(not (codegen.available() and hardware.has_any(hardware.BF16_ISA)),
                    reason="no C compiler, or no native BF16 (BF16 tactics are offered only there)")
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("x_dtype,y_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                             ("bfloat16", "float32")])
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_bf16_global_pools_accumulate_wide_and_round_once(op, x_dtype, y_dtype, layout):
    """A squeeze-excite block's average between BF16 layers: bf16 or FP32 in, either out, the sum in double, so the
    only error is the output's one rounding (the maximum is exact). NaN propagates."""
    shape = (2, 100, 14, 14)
    x = channels_last(shape, seed=5).to(getattr(torch, x_dtype)).contiguous(memory_format=layout)
    x[1, 7, 3, 4] = float("nan")
    view_ = LayerView(op, "", {}, (shape,), (x_dtype,), {}, (y_dtype,), 17, ((),))
    tactic = NhwcPoolBf16Tactic()
    assert tactic.supports(view_)
    got = tactic.prepare(view_)([x])[0]
    xd = x.double()
    exact = xd.mean(dim=(2, 3), keepdim=True) if op == "GlobalAveragePool" else xd.amax(dim=(2, 3), keepdim=True)
    want = exact.to(getattr(torch, y_dtype))   # the exact result rounded once to the output's type
    assert got.dtype == want.dtype and got.shape == (2, 100, 1, 1)
    assert torch.equal(got.float().nan_to_num(9.0), want.float().nan_to_num(9.0))
    assert bool(got[1, 7].isnan()) and int(got.float().isnan().sum()) == 1


def test_a_dynamo_exported_global_average_runs_on_the_pool_kernel_in_an_engine():
    """torch.onnx's dynamo exporter writes adaptive_avg_pool2d(x, 1) as ReduceMean with opset 18's axes input,
    then Reshape and Gemm: the engine offers that ReduceMean the pool kernel (first in registry order, so chosen
    without timing) as it does a GlobalAveragePool, and the result equals onnxruntime's."""
    import kiln
    from kiln.tactics.registry import REGISTRY
    from tests.conftest import assert_close_to_ort, init, rand

    for op in ("ReduceMean", "ReduceMax"):   # the pool tactics and the bf16 reference both stay candidates
        assert [t.name for t in REGISTRY[op]] == ["kiln.pool2d_nhwc", "kiln.pool2d_nhwc_bf16", "torch.reference_bf16"]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="node_conv"),
             helper.make_node("Relu", ["c"], ["r"], name="node_relu"),
             helper.make_node("ReduceMean", ["r", "axes"], ["mean"], keepdims=1, name="node_mean"),
             helper.make_node("Reshape", ["mean", "shape"], ["flat"], name="node_view"),
             helper.make_node("Gemm", ["flat", "fc"], ["y"], transB=1, name="node_linear")]
    inits = [init("w", rand((24, 8, 3, 3), 1) * 0.2), init("axes", np.array([-1, -2], np.int64)),
             init("shape", np.array([1, 24], np.int64)), init("fc", rand((10, 24), 2))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 14, 14])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits, opset=18)
    engine = kiln.build(model, tactic_sources="kiln,torch", autotune=False)
    chosen = {layer.name: layer.tactic_name for layer in engine.plan.layers}
    assert chosen["node_mean"] == "kiln.pool2d_nhwc", chosen
    feeds = {"x": rand((1, 8, 14, 14), 3)}
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])
