"""INT8 average pools: DequantizeLinear -> AveragePool / GlobalAveragePool / ReduceMean(H, W) -> QuantizeLinear (and
QOperator's QLinearAveragePool) build into one INT8 QAveragePool layer on kiln.pool2d_nhwc_int8, equal to the
exact rounding of the mean and within one output step of onnxruntime; an onnxruntime region gets the Q/DQ form
back."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from tests.conftest import force_plan, init, make_model, run_ort

OWN = "-openvino,-onnxruntime"
X_SCALE, Y_SCALE = 0.0173, 0.0121


def pooled_model(pool: helper.NodeProto, x_shape, y_shape, x_type=TensorProto.UINT8, y_type=TensorProto.UINT8,
                 x_zp=37, y_zp=50, opset=19):
    """x (float) -> Q -> DQ -> `pool` (reads "xd", writes "p") -> Q -> DQ -> y, zero points of the given types."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]), pool,
             helper.make_node("QuantizeLinear", ["p", "ys", "yz"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "ys", "yz"], ["y"])]
    x_np, y_np = (helper.tensor_dtype_to_np_dtype(t) for t in (x_type, y_type))
    inits = [init("xs", np.float32(X_SCALE)), init("xz", np.array(x_zp, x_np)), init("ys", np.float32(Y_SCALE)),
             init("yz", np.array(y_zp, y_np)), init("axes", np.array([2, 3], np.int64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], inits, opset=opset)


def exact_levels(x: np.ndarray, x_zp: int, y_zp: int, y_type, **window) -> np.ndarray:
    """The INT8 result of the exact mean: (integer window sum of x - zero point) / count * x_scale / y_scale as a
    float32, rounded half to even, plus y's zero point, saturated."""
    centred = torch.from_numpy(x.astype(np.float64) - x_zp)
    mean = torch.nn.functional.avg_pool2d(centred, **window) if window else centred.mean((2, 3), keepdim=True)
    level = np.round((mean.numpy() * (np.float64(np.float32(X_SCALE)) / np.float64(np.float32(Y_SCALE))))
                     .astype(np.float32)) + y_zp
    info = np.iinfo(y_type)
    return np.clip(level, info.min, info.max)


def quantized_input(shape, seed: int) -> np.ndarray:
    """Floats spread over the whole input range, so the quantized taps hit both ends."""
    return np.random.default_rng(seed).uniform(-1.5, 4.0, shape).astype(np.float32)


def check(model, x: np.ndarray, window: dict | None, x_type, x_zp: int, y_type, y_zp: int,
          threads: int = 1) -> kiln.Engine:
    """Builds `model` with --int8 on kiln's kernels: its pool is one INT8 layer whose output is the exact rounding of
    the mean of the quantized input (`window`: avg_pool2d's arguments; None: the global mean), at most one output
    step from onnxruntime's."""
    engine = kiln.build(model, int8=True, tactic_sources=OWN, autotune=False, threads=threads)
    (pool,) = [l for l in engine.plan.layers if l.op_type == "QAveragePool"]
    assert (pool.tactic_name, pool.precision, pool.outputs[0].dtype) == \
        ("kiln.pool2d_nhwc_int8", "INT8", np.dtype(y_type).name)
    got = engine.run({"x": x})["y"]
    assert np.abs(got - run_ort(model, {"x": x})[0]).max() <= Y_SCALE * 1.001
    info = np.iinfo(x_type)
    x_levels = np.clip(np.round(x / np.float32(X_SCALE)) + x_zp, info.min, info.max)
    exact = exact_levels(x_levels, x_zp, y_zp, y_type, **(window or {}))
    np.testing.assert_array_equal(np.round(got / np.float32(Y_SCALE)) + y_zp, exact.reshape(got.shape))
    return engine


@pytest.mark.parametrize("x_type, y_type, x_zp, y_zp", [(TensorProto.UINT8, TensorProto.UINT8, 37, 50),
                                                        (TensorProto.INT8, TensorProto.INT8, -20, 5),
                                                        (TensorProto.UINT8, TensorProto.INT8, 37, -9),
                                                        (TensorProto.INT8, TensorProto.UINT8, -20, 120)])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_window_average_pool_is_one_int8_layer(x_type, y_type, x_zp, y_zp, include_pad):
    pool = helper.make_node("AveragePool", ["xd"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                            count_include_pad=include_pad)
    model = pooled_model(pool, [2, 96, 9, 9], [2, 96, 5, 5], x_type, y_type, x_zp, y_zp)   # blocks of 64 and 32
    window = {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": bool(include_pad)}
    engine = check(model, quantized_input((2, 96, 9, 9), 1), window, helper.tensor_dtype_to_np_dtype(x_type), x_zp,
                   helper.tensor_dtype_to_np_dtype(y_type), y_zp)
    assert [l.op_type for l in engine.plan.layers if l.op_type != "Reformat"] == \
        ["QuantizeLinear", "QAveragePool", "DequantizeLinear"]   # and the output's layout copy
    shown = next(d for d in engine.layer_info("detailed")["Layers"] if "AveragePool" in d["Name"])
    assert (shown["ParameterType"], shown["PoolingType"], shown["GrantedPrecision"]) == ("Pooling", "AVERAGE", "INT8")


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("pool, y_shape, opset", [
    (helper.make_node("GlobalAveragePool", ["xd"], ["p"]), [1, 80, 1, 1], 19),
    (helper.make_node("ReduceMean", ["xd", "axes"], ["p"], keepdims=0), [1, 80], 19),
    (helper.make_node("ReduceMean", ["xd"], ["p"], axes=[-2, -1]), [1, 80, 1, 1], 13)],
    ids=["global", "reduce_mean", "reduce_mean_axes_attribute"])
def test_global_averages_over_more_pixels_than_an_int32_chunk_sum_exactly(pool, y_shape, opset, threads):
    """270 x 270 = 72,900 pixels: on one thread more than the 65,536 the kernel sums in int32 before carrying into
    int64; 80 channels, a block of 64 and one of 16, on 4 threads each split into pixel segments."""
    model = pooled_model(pool, [1, 80, 270, 270], y_shape, x_zp=37, y_zp=50, opset=opset)
    check(model, quantized_input((1, 80, 270, 270), 2), None, np.uint8, 37, np.uint8, 50, threads=threads)


def test_qoperator_average_pools_fuse_too_and_an_onnxruntime_region_gets_the_qdq_form(monkeypatch):
    """QOperator's com.microsoft QLinearAveragePool unfolds to DQ -> AveragePool -> Q and becomes the same INT8
    layer; built as one onnxruntime region, the layer is written back as that Q/DQ graph (exact to onnxruntime)."""
    node = helper.make_node("QLinearAveragePool", ["xq", "xs", "xz", "ys", "yz"], ["pq"], domain="com.microsoft",
                            kernel_shape=[2, 2], strides=[2, 2])
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), node,
             helper.make_node("DequantizeLinear", ["pq", "ys", "yz"], ["y"])]
    inits = [init("xs", np.float32(X_SCALE)), init("xz", np.uint8(37)), init("ys", np.float32(Y_SCALE)),
             init("yz", np.uint8(50))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 4, 4])], inits)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    x = quantized_input((1, 16, 8, 8), 3)
    check(model, x, {"kernel_size": 2, "stride": 2}, np.uint8, 37, np.uint8, 50)
    force_plan(monkeypatch, "onnxruntime")
    region = kiln.build(model, int8=True, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    assert [l.op_type for l in region.plan.layers[0].inner] == ["QuantizeLinear", "QAveragePool", "DequantizeLinear"]
    np.testing.assert_array_equal(region.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_an_empty_batch_pools_to_an_empty_output():
    """A dynamic batch of 0 reaches the global pool's kernel: nothing to sum, no division by the unit count."""
    from kiln.tactics.base import LayerView
    from kiln.tactics.pool_c import QuantizedPoolTactic

    quant = {"x_scale": 0.5, "x_zero_point": 3, "x_dtype": "uint8", "y_scale": 0.25, "y_zero_point": 7,
             "y_dtype": "uint8"}
    layer = LayerView("QAveragePool", "kiln", {"pool": "GlobalAveragePool", "quant": quant}, ((2, 80, 5, 5),),
                      ("uint8",), {}, ("uint8",), 19, ((0,),))
    assert QuantizedPoolTactic().supports(layer)
    x = torch.zeros((0, 80, 5, 5), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    assert QuantizedPoolTactic().prepare(layer)([x])[0].shape == (0, 80, 1, 1)


@pytest.mark.parametrize("mode, x_type, y_type", [("linear", TensorProto.UINT8, TensorProto.UINT8),
                                                  ("cubic", TensorProto.INT8, TensorProto.UINT8)])
def test_linear_and_cubic_resize_between_qdq_is_one_int8_layer(mode, x_type, y_type, monkeypatch):
    """DQ -> Resize(linear | cubic) -> Q: one QResize on kiln.resize_interpolate_int8, each output within one step of
    onnxruntime and of the FP32 chain it replaces (dequantized, resized by torch's interpolate, which takes ONNX's
    half_pixel rule and cubic coefficient -0.75, quantized), equal to it almost everywhere (FP32 sums in another
    order); an onnxruntime region gets the Q/DQ form back."""
    x_zp, y_zp = (37, -9) if x_type == TensorProto.UINT8 else (-20, -9)
    y_zp = 50 if y_type == TensorProto.UINT8 else y_zp
    node = helper.make_node("Resize", ["xd", "", "scales"], ["p"], mode=mode)
    model = pooled_model(node, [2, 40, 7, 9], [2, 40, 14, 18], x_type, y_type, x_zp, y_zp)
    model.graph.initializer.append(init("scales", np.array([1, 1, 2, 2], np.float32)))
    x = quantized_input((2, 40, 7, 9), 4)
    engine = kiln.build(model, int8=True, tactic_sources=OWN, autotune=False)
    (layer,) = [l for l in engine.plan.layers if l.op_type == "QResize"]
    assert (layer.tactic_name, layer.precision) == ("kiln.resize_interpolate_int8", "INT8")
    got = engine.run({"x": x})["y"]
    assert np.abs(got - run_ort(model, {"x": x})[0]).max() <= Y_SCALE * 1.001
    x_np = helper.tensor_dtype_to_np_dtype(x_type)
    levels = np.clip(np.round(x / np.float32(X_SCALE)) + x_zp, np.iinfo(x_np).min, np.iinfo(x_np).max).astype(x_np)
    floats = torch.from_numpy((levels.astype(np.float32) - x_zp) * np.float32(X_SCALE))
    torch_mode = "bilinear" if mode == "linear" else "bicubic"
    resized = torch.nn.functional.interpolate(floats, scale_factor=2, mode=torch_mode, align_corners=False).numpy()
    y_np = helper.tensor_dtype_to_np_dtype(y_type)
    want = np.clip(np.round(resized / np.float32(Y_SCALE)) + y_zp, np.iinfo(y_np).min, np.iinfo(y_np).max)
    steps = np.abs(np.round(got / np.float32(Y_SCALE)) + y_zp - want)
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.99
    force_plan(monkeypatch, "onnxruntime")
    region = kiln.build(model, int8=True, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    assert "QResize" in [l.op_type for l in region.plan.layers[0].inner]
    np.testing.assert_array_equal(region.run({"x": x})["y"], run_ort(model, {"x": x})[0])
