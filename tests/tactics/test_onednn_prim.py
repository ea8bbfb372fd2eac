"""kiln's own oneDNN INT8 convolution primitive (source "onednn", oneDNN's C API): made once per input shape at
load, run with two data pointers per call. A quantize_static ResNet-18 on that source alone (its classifier on
the INT8 matmul primitive) matches onnxruntime and survives save/load; a second input shape gets a primitive of
its own; calls from two threads give one thread's bytes; a configuration oneDNN refuses fails at prepare with
oneDNN's reason; without oneDNN's C API the source is not offered and an engine using it runs through torch's
oneDNN ops, with one warning. (Formula checks: test_onednn_int8.py runs its convolution and linear cases on both
oneDNN tactics.)"""
from __future__ import annotations


import numpy as np
import pytest
import torch

import kiln
from kiln import native
from kiln.native import external
from kiln.tactics import onednn_prim
from kiln.tactics.onednn_int8 import int8_available
from kiln.tactics.onednn_prim import ConvCall, Primitive, PrimitiveInt8ConvTactic
from kiln.tactics.registry import available_sources, parse_sources
from tests.conftest import cosine, on_threads, run_ort
from tests.precision.test_qdq import quantized_resnet18
from tests.tactics.test_onednn_int8 import close_quantized, conv_view, formula, quant

pytestmark = [
    pytest.mark.skipif(not int8_available(), reason="this CPU has no VNNI or AMX-INT8: oneDNN's INT8 kernels are "
                       "not offered"),
    pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here (pip install "
                       f"{external.ONEDNN_WHEELS})")]


def test_resnet18_on_the_onednn_source_alone_matches_onnxruntime_and_reloads(tmp_path):
    qdq, _ = quantized_resnet18(tmp_path, "QDQ")
    engine = kiln.build(qdq, tactic_sources="onednn")
    convs = [l for l in engine.plan.layers if l.op_type == "QConv"]
    assert len(convs) == 20 and {(l.tactic_name, l.source, l.precision) for l in convs} == \
        {("onednn.qconv2d_primitive", "onednn", "INT8")}
    assert sum(len(l.inputs) == 2 for l in convs) == 8   # the residual sums, fused as oneDNN's sum post-op
    fc = [(l.op_type, l.tactic_name, l.precision) for l in engine.plan.layers if l.op_type in ("QGemm", "QMatMul")]
    assert fc == [("QGemm", "onednn.qlinear_primitive", "INT8")]   # the classifier, on oneDNN's matmul
    x = np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)
    got, want = engine.run({"input": x})["output"], run_ort(qdq, {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()
    engine.save(tmp_path / "r18.kiln")
    again = kiln.load(tmp_path / "r18.kiln").run({"input": x})["output"]
    np.testing.assert_array_equal(again, got)   # the primitives are made again at load, to the same bytes


def conv_model(folder) -> str:
    """x -> Q/DQ -> Conv(8->16, 3x3, weights Q/DQ per channel) + bias -> Q/DQ -> y: one INT8 convolution."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    w = rng.integers(-100, 100, (16, 8, 3, 3)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"), numpy_helper.from_array(np.full(16, 0.01, np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(16, np.int8), "w_z"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(0.03, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "ys"),
             numpy_helper.from_array(np.array(3, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "qconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])], inits)
    path = str(folder / "qconv.onnx")
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def example(batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (32, 24, 3, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (batch, 24, 13, 11), generator=g, dtype=torch.uint8)
    return conv_view((1, 24, 13, 11), w, q=quant(w_scale=[0.003 + 0.0005 * i for i in range(32)])), x


def test_another_input_shape_gets_a_primitive_of_its_own():
    view, x3 = example(batch=3)
    kernel = PrimitiveInt8ConvTactic().prepare(view)   # made for batch 1 at load
    close_quantized(kernel([x3[:1], None, None])[0], formula(view, x3[:1]))
    got = kernel([x3, None, None])[0]
    assert got.shape == (3, 32, 13, 11)
    close_quantized(got, formula(view, x3))


def test_calls_from_two_threads_give_one_threads_bytes():
    view, x = example(batch=2, seed=1)
    kernel = PrimitiveInt8ConvTactic().prepare(view)
    inputs = [x[i:i + 1].clone() for i in range(2)]
    alone = [kernel([xi, None, None])[0].clone() for xi in inputs]
    for xi, yi in zip(inputs, alone):
        close_quantized(yi, formula(view, xi))
    mismatches = []

    def hammer(i):
        for _ in range(40):
            if not torch.equal(kernel([inputs[i], None, None])[0], alone[i]):
                mismatches.append(i)
    on_threads(hammer, 2)
    assert not mismatches


def test_a_configuration_onednn_refuses_fails_at_prepare_with_its_reason():
    lib = native.library("onednn")
    w, scales = torch.zeros(8, 3, 3, 3, dtype=torch.int8), torch.ones(8)
    call = ConvCall(n=1, c=3, h=8, w=8, cout=8, kh=3, kw=3, sh=1, sw=1, dh=1, dw=1, groups=2,   # 3 channels, 2 groups
                    x_type=1, w_type=2, y_type=1, r_type=-1, x_scale=1, y_scale=1, w_scale=scales.data_ptr(),
                    weights=w.data_ptr())
    with pytest.raises(RuntimeError, match=r"oneDNN made no convolution for this layer: dnnl_\w+: "):
        Primitive(lib, "conv", call)


def test_without_onednns_c_api_the_source_is_not_offered_and_its_engines_run_through_torch(monkeypatch, tmp_path,
                                                                                             caplog):
    view, x = example()
    engine = kiln.build(conv_model(tmp_path), tactic_sources="onednn")   # alone: chosen by rule, not timing
    assert "onednn.qconv2d_primitive" in {l.tactic_name for l in engine.plan.layers}
    engine.save(tmp_path / "conv.kiln")
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 8, 12, 12)).astype(np.float32)}
    want = engine.run(feeds)["y"]
    monkeypatch.setattr(external, "onednn_prefix", lambda: None)
    with caplog.at_level("WARNING", logger="kiln"):
        elsewhere = kiln.load(tmp_path / "conv.kiln").run(feeds)["y"]
    assert "onednn.qconv2d_primitive links onednn, which is not installed here" in caplog.text
    assert "its layers run on onednn.qconv2d_nhwc_prepacked, in the same precision" in caplog.text
    reference = run_ort(str(tmp_path / "qconv.onnx"), feeds)[0]
    for got in (want, elsewhere):   # both within one output step (scale 0.05) of onnxruntime
        np.testing.assert_allclose(got, reference, atol=0.05 + 1e-6)
    assert not native.buildable("onednn") and not onednn_prim.available()
    assert "onednn" not in available_sources() and not PrimitiveInt8ConvTactic().supports(view)
    with pytest.raises(kiln.Error, match="tactic source 'onednn' is not available on this machine"):
        parse_sources("+onednn")
