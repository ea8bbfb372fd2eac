"""Dynamically quantized CNNs (onnxruntime's quantize_dynamic on convolutions: DynamicQuantizeLinear -> ConvInteger
-> Cast -> Mul -> Add(bias)) run each convolution as one INT8 DynamicQConv layer, with BatchNormalization, the FP32
residual sum and the activation folded in, bit for bit as onnxruntime runs them where nothing is folded; before, the chain ran op by op,
the convolution on the reference kernel (in float64)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.tactics.qgemm_c import vnni_available
from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.precision.test_dynamic_quant import KILN_ONLY, needs_vnni, quantize_dynamic
from tests.tactics.amx import amx_int8_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)

KERNELS = {"kiln.dynamic_qconv2d_direct_nhwc_int8", "kiln.dynamic_qconv2d_direct_nhwc_amx_int8"}   # AMX-INT8: both race


def three_convs(batch: int = 2) -> onnx.ModelProto:
    """x [batch, 5, 13, 11] -> 3x3 conv (pads 1) + ReLU -> 3x3 stride-2 conv (SAME_UPPER) + LeakyRelu -> 1x1 conv,
    summed with its input, ReLU: channel counts off every blocking, odd sizes, padding and a residual."""
    h = helper.make_node
    nodes = [h("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             h("Relu", ["c1"], ["r1"], name="relu1"),
             h("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", strides=[2, 2], auto_pad="SAME_UPPER"),
             h("LeakyRelu", ["c2"], ["r2"], name="leaky", alpha=0.1),
             h("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"), h("Add", ["c3", "r2"], ["s"], name="sum"),
             h("Relu", ["s"], ["y"], name="relu3")]
    inits = [init("w1", rand((19, 5, 3, 3), 1) * 0.3), init("b1", rand((19,), 2)),
             init("w2", rand((37, 19, 3, 3), 3) * 0.2), init("b2", rand((37,), 4)),
             init("w3", rand((37, 37, 1, 1), 5) * 0.2), init("b3", rand((37,), 6))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 5, 13, 11])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 37, 7, 6])], inits)


def chain_name(conv: str, output: str, tail: str) -> str:
    """A DynamicQConv's layer name: quantize_dynamic's nodes around `conv`, then the model's nodes it absorbed."""
    return (f"{conv}_quant + {output}_output_quantized_cast + {conv}_quant_output_scale_mul + {output}_bias_add + "
            f"{conv}_quant_scales_mul + {tail}")


@pytest.mark.parametrize("sources", [pytest.param("kiln", marks=needs_vnni), "torch", "onnxruntime"])
def test_each_convolution_is_one_int8_layer_equal_to_onnxruntime_bit_for_bit(tmp_path, monkeypatch, sources):
    from tests.conftest import force_plan

    if sources == "onnxruntime":   # the whole-graph region, not its layers one by one, whichever times faster here
        force_plan(monkeypatch, "onnxruntime")
    path = quantize_dynamic(three_convs(), tmp_path / "q.onnx")
    assert Counter(n.op_type for n in onnx.load(path).graph.node)["ConvInteger"] == 3
    engine = kiln.build(path, tactic_sources=sources)
    x = {"x": rand((2, 5, 13, 11), 7) * 2 + 0.3}
    np.testing.assert_array_equal(engine.run(x)["y"], run_ort(path, x)[0])
    if sources == "onnxruntime":   # the region gets quantize_dynamic's ops back
        assert [l.op_type for l in engine.plan.layers] == ["Region"]
        return
    convs = [l for l in engine.plan.layers if l.op_type == "DynamicQConv"]
    assert [l.name for l in convs] == [chain_name("conv1", "c1", "x_QuantizeLinear + relu1"),
                                       chain_name("conv2", "c2", "r1_QuantizeLinear + leaky"),
                                       chain_name("conv3", "c3", "r2_QuantizeLinear + sum + relu3")]
    assert all(l.precision == "INT8" and l.tactic_name in (KERNELS if sources == "kiln" else {"torch.reference"})
               for l in convs)
    assert [l.op_type for l in engine.plan.layers if l.op_type != "Reformat"] == ["DynamicQConv"] * 3
    assert [v.name for v in convs[2].inputs] == ["r2", "r2"]   # x, and the same tensor as the FP32 residual


def test_batchnorm_folds_into_the_int8_convolutions_scales(tmp_path):
    """A ResNet-18 exported with every BatchNormalization kept: each folds into its DynamicQConv's per-channel
    scales and bias (the integer weights stay), each block's residual sum and ReLU into its epilogue; 20 INT8
    convolutions and the INT8 classifier, nothing between them. Folding rounds differently from onnxruntime's separate ops, so outputs agree to a cosine."""
    import torch

    from tests.models import nets

    fp32 = tmp_path / "r18.onnx"
    nets.export(nets.make("resnet18"), torch.randn(1, 3, 32, 32), fp32, "legacy")
    path = quantize_dynamic(str(fp32), tmp_path / "r18_int8.onnx")
    engine = kiln.build(path, tactic_sources=KILN_ONLY)
    ops = Counter(l.op_type for l in engine.plan.layers)
    assert (ops["DynamicQConv"], ops["DynamicQMatMul"]) == (20, 1)
    assert not {"BatchNormalization", "ConvInteger", "DynamicQuantizeLinear", "Relu", "Conv", "PointWise"} & set(ops)
    blocks = [f"/layer{stage}/layer{stage}.{i}" for stage in range(1, 5) for i in range(2)]
    summed = [l for l in engine.plan.layers if l.op_type == "DynamicQConv" and len(l.inputs) == 2]   # x, residual
    assert [l.name.split(" + ")[-3:] for l in summed] == \
        [[f"{b}/bn2/BatchNormalization", f"{b}/Add", f"{b}/relu_1/Relu"] for b in blocks]
    info = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    assert [info[l.name]["HasResidual"] for l in summed] == [1] * 8
    shortcuts = [l.inputs[1].name for l in summed]
    assert shortcuts[:2] == ["/maxpool/MaxPool_output_0", "/layer1/layer1.0/relu_1/Relu_output_0"]
    assert shortcuts[2] == "/layer2/layer2.0/downsample/downsample.1/BatchNormalization_output_0"
    stem = next(l for l in engine.plan.layers if l.op_type == "DynamicQConv")
    assert info[stem.name]["HasResidual"] == 0
    assert "BatchNormalization" in stem.name and stem.name.endswith("relu/Relu") and stem.precision == "INT8"
    x = {"input": rand((1, 3, 32, 32), 8)}
    got = engine.run(x)["output"]
    assert cosine(got, run_ort(path, x)[0]) > 0.9999
    assert cosine(got, run_ort(str(fp32), x)[0]) > 0.99


def conv_layer(padding: int = 1, cin: int = 21, cout: int = 45, seed: int = 9, residual: bool = False):
    """A 3x3 DynamicQConv's LayerView and operands [x, W, bias] (+ an FP32 residual of the output's shape, then
    ReLU): s8 weights, per-channel scales."""
    import torch

    from kiln.tactics.base import LayerView

    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.integers(-127, 128, (cout, cin, 3, 3)).astype(np.int8))
    bias = torch.from_numpy(rng.standard_normal(cout).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((2, cin, 9, 10)).astype(np.float32))
    quant = {"x_dtype": "uint8", "w_axis": 0, "w_scale": (rng.random(cout) * 0.01 + 1e-3).tolist(),
             "w_zero_point": [0] * cout}
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [padding] * 4, "dilations": [1, 1], "group": 1,
             "quant": quant}
    shapes, dtypes, xs = (tuple(x.shape), tuple(w.shape), (cout,)), ("float32", "int8", "float32"), [x, w, bias]
    if residual:
        r = torch.from_numpy(rng.standard_normal((2, cout, 9 + 2 * padding - 2, 10 + 2 * padding - 2)).astype(np.float32))
        shapes, dtypes, xs = shapes + (tuple(r.shape),), dtypes + ("float32",), xs + [r]
        attrs["activation"] = {"op": "Relu", "attrs": {}}
    return LayerView("DynamicQConv", "kiln", attrs, shapes, dtypes, {1: w, 2: bias}), xs


def onnxruntime_conv_chain(view, x, residual=None) -> np.ndarray:
    """onnxruntime running the layer as quantize_dynamic writes it (per-channel scales as a [C, 1, 1] constant),
    with the residual's Add and ReLU after it where given."""
    h = helper.make_node
    w, bias = view.const_inputs[1].numpy(), view.const_inputs[2].numpy()
    pads = view.attrs["pads"]
    nodes = [h("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             h("ConvInteger", ["xq", "w", "xz"], ["i"], pads=pads), h("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
             h("Mul", ["xs", "ws"], ["s"]), h("Mul", ["f", "s"], ["m"]), h("Add", ["m", "b"], ["y"])]
    feeds = {"x": np.asarray(x)}
    if residual is not None:
        nodes[-1].output[0] = "biased"
        nodes += [h("Add", ["biased", "r"], ["summed"]), h("Relu", ["summed"], ["y"])]
        feeds["r"] = np.asarray(residual)
    inits = [init("w", w), init("ws", np.asarray(view.attrs["quant"]["w_scale"], np.float32).reshape(-1, 1, 1)),
             init("b", bias.reshape(-1, 1, 1))]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(v.shape)) for name, v in feeds.items()]
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=17)
    return run_ort(model, feeds)[0]


@needs_vnni
@pytest.mark.parametrize("case", ["mixed", "zeros", "negative", "positive"])
def test_the_kernel_pads_with_the_calls_zero_point_as_onnxruntime(case):
    """Padded pixels must read as the quantized zero, which moves with every input: mid-range for mixed signs,
    255 for an all-negative input, 0 for an all-positive one (and scale 1 for all zeros)."""
    import torch

    from kiln.tactics.dqgemm_c import DynamicQConvTactic

    view, (x, w, bias) = conv_layer()
    x = {"zeros": x * 0, "negative": -x.abs() - 0.1, "positive": x.abs() + 0.1}.get(case, x)
    got = DynamicQConvTactic().prepare(view)([x.contiguous(memory_format=torch.channels_last), w, bias])[0]
    np.testing.assert_array_equal(got.numpy(), onnxruntime_conv_chain(view, x))


@needs_vnni
@pytest.mark.parametrize("padding", [0, 1])
def test_the_kernel_adds_an_fp32_residual_before_relu_as_onnxruntime(padding):
    """The residual sum in the epilogue, read from the residual's buffer or written over it (the runtime's variant
    for a residual that dies here): onnxruntime's Add then Relu, bit for bit."""
    import torch

    from kiln.tactics.dqgemm_c import DynamicQConvTactic

    view, (x, w, bias, r) = conv_layer(padding=padding, residual=True)
    want = onnxruntime_conv_chain(view, x, r)
    last = torch.channels_last
    run = DynamicQConvTactic().prepare(view)
    x, r = x.contiguous(memory_format=last), r.contiguous(memory_format=last)
    kept = r.clone()
    np.testing.assert_array_equal(run([x, w, bias, r])[0].numpy(), want)
    assert torch.equal(r, kept)   # a live residual is only read
    assert np.any(want == 0) and np.any(want > 0)   # ReLU clipped some sums, not all
    assert not np.array_equal(want, onnxruntime_conv_chain(view, x, r * 0))   # the residual counts
    index, into_residual = run.into_input
    assert index == 3
    buffer = r.clone(memory_format=last)
    got = into_residual([x, w, bias, buffer])[0]
    assert got.data_ptr() == buffer.data_ptr()
    np.testing.assert_array_equal(got.numpy(), want)


@needs_vnni
def test_the_amx_variant_equals_onnxruntime(amx_int8_kernels):
    """On AMX-INT8 tiles (emulated in C where this CPU has none): the same sums, so onnxruntime's floats."""
    import torch

    from kiln.tactics.dqgemm_c import DynamicQConvAmxTactic

    view, (x, w, bias) = conv_layer(cin=70)
    amx = DynamicQConvAmxTactic()
    assert amx.supports(view)
    got = amx.prepare(view)([x.contiguous(memory_format=torch.channels_last), w, bias])[0]
    np.testing.assert_array_equal(got.numpy(), onnxruntime_conv_chain(view, x))
    view, (x, w, bias, r) = conv_layer(cin=70, residual=True)   # and with the FP32 residual (elements, not bytes)
    last = torch.channels_last
    got = amx.prepare(view)([x.contiguous(memory_format=last), w, bias, r.contiguous(memory_format=last)])[0]
    np.testing.assert_array_equal(got.numpy(), onnxruntime_conv_chain(view, x, r))


def test_grouped_convolutions_fuse_and_run_on_the_reference_kernel_and_unsigned_weights_on_kilns_exactly(tmp_path):
    """kiln's INT8 convolution takes one group: a depthwise convolution fuses all the same and runs on the reference
    op; quantize_dynamic's QUInt8 weights (asymmetric, or symmetric around 128) run on kiln's kernel. All exact."""
    from onnxruntime.quantization import QuantType

    h = helper.make_node
    nodes = [h("Conv", ["x", "w1", "b1"], ["c1"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             h("Conv", ["c1", "w2"], ["y"], name="pointwise")]
    inits = [init("w1", rand((8, 1, 3, 3), 1)), init("b1", rand((8,), 2)), init("w2", rand((16, 8, 1, 1), 3))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 6, 6])], inits)
    x = {"x": rand((1, 8, 6, 6), 4)}
    cases = ((QuantType.QInt8, {}, {"depthwise"}), (QuantType.QUInt8, {}, {"depthwise"}),
             (QuantType.QUInt8, {"WeightSymmetric": True}, {"depthwise"}))
    for case, (weight_type, extra, reference) in enumerate(cases):
        path = quantize_dynamic(model, tmp_path / f"q{case}.onnx", weight_type=weight_type, extra_options=extra)
        engine = kiln.build(path, tactic_sources="kiln", autotune=False)   # the first tactic that takes it
        convs = {l.name.split("_quant")[0]: l for l in engine.plan.layers if l.op_type == "DynamicQConv"}
        assert set(convs) == {"depthwise", "pointwise"} and all(l.precision == "INT8" for l in convs.values())
        on_reference = {name for name, l in convs.items() if l.tactic_name == "torch.reference"}
        assert on_reference == (reference if vnni_available() else {"depthwise", "pointwise"})
        np.testing.assert_array_equal(engine.run(x)["y"], run_ort(path, x)[0])


def test_an_openvino_region_reports_the_fp32_it_ran_the_dynamic_convolutions_in(monkeypatch, tmp_path):
    """OpenVINO runs quantize_dynamic's ConvInteger chain in FP32 (its execution graph says so), where it runs a
    quantize_static convolution in INT8: an OpenVINO region's inner layers are granted what it ran, with the reason,
    not the INT8 they asked for."""
    pytest.importorskip("openvino")
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tests.conftest import force_plan
    from tests.precision.test_qdq import calibration_reader

    force_plan(monkeypatch, "openvino")
    fp32 = tmp_path / "m.onnx"
    onnx.save(three_convs(batch=1), fp32)
    static = tmp_path / "static.onnx"
    quantize_static(str(fp32), str(static), calibration_reader("x", (1, 5, 13, 11), 3), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    for path, want in ((quantize_dynamic(str(fp32), tmp_path / "dynamic.onnx"), "FP32"), (str(static), "INT8")):
        engine = kiln.build(path, tactic_sources="-onnxruntime")
        info = [l for l in engine.layer_info()["Layers"] if l["LayerType"] == "OpenVINOConvolution"]
        assert len(info) == 3 and {l["RequestedPrecision"] for l in info} == {"INT8"}, path
        granted, fp32 = {(l["GrantedPrecision"], l.get("PrecisionReason", "")) for l in info}, \
            ("FP32", "the OpenVINO region ran it in FP32")
        if want == "FP32":
            assert granted == {fp32}, path
        elif "amx_int8" in hardware.cpu_isa():   # there OpenVINO ran one of the three in FP32: reported as such
            assert ("INT8", "") in granted and granted <= {("INT8", ""), fp32}, path
        else:
            assert granted == {("INT8", "")}, path
