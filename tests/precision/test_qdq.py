"""Explicit quantization: Q/DQ models (onnxruntime's quantize_static in QDQ format, hand-built ones) build into
INT8 layers, match onnxruntime's own execution, report requested/granted precision; the classic
"INT8 conv with FP32 output" case is warned about at build time and named by `kiln lint`."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import native
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.qgemm_c import vnni_available
from tests.conftest import cosine, init, make_model, run_ort
from kiln.trt.vocab import parameter_type


def calibration_reader(name: str, shape: tuple[int, ...], batches: int, uniform: bool = False):
    """onnxruntime's CalibrationDataReader over seeded random batches for input `name`."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            rngs = [np.random.default_rng(i) for i in range(batches)]
            self.batches = iter([{name: (r.random(shape) if uniform else r.standard_normal(shape)).astype(np.float32)}
                                 for r in rngs])

        def get_next(self):
            return next(self.batches, None)
    return Reader()


def quantized_resnet18(folder, quant_format: str) -> tuple[str, str]:
    """(quantized, pre-processed FP32) paths of a 64x64 ResNet-18 through onnxruntime's quantize_static in
    `quant_format` ("QDQ" or "QOperator"): per-channel s8 weights, u8 activations."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from tests.models.nets import export, make

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(make("resnet18"), torch.randn(1, 3, 64, 64), folder / "fp32.onnx", "legacy")
    quant_pre_process(str(folder / "fp32.onnx"), str(folder / "pre.onnx"))
    quantize_static(str(folder / "pre.onnx"), str(folder / "quantized.onnx"),
                    calibration_reader("input", (1, 3, 64, 64), 4), quant_format=QuantFormat[quant_format],
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return str(folder / "quantized.onnx"), str(folder / "pre.onnx")


@pytest.fixture(scope="module")
def qdq_resnet(tmp_path_factory):
    return quantized_resnet18(tmp_path_factory.mktemp("qdq"), "QDQ")[0]


def test_quantize_static_resnet_builds_int8_layers_and_matches_onnxruntime(qdq_resnet, caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    engine = kiln.build(qdq_resnet, autotune=False)
    convs = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert len(convs) == 20 and all(l.op_type == "QConv" and l.precision == "INT8" for l in convs)
    assert sum(l.op_type == "QGemm" for l in engine.plan.layers) == 1
    # the 8 INT8 residual adds (with their ReLU) fuse into the second conv of each block
    assert sum(l.op_type == "QAdd" for l in engine.plan.layers) == 0
    fused = [l for l in convs if len(l.inputs) == 2]
    assert len(fused) == 8 and all("/Add + " in l.name and "relu_1/Relu" in l.name for l in fused)
    # 20 convs, the FC, maxpool on INT8 (Q/DQ swapped around it), the INT8 global pool (its DQ and Q inside),
    # flatten, the input's Q and the output's DQ; copies between layouts (channel-major INT8 kernels where the CPU
    # has VNNI) are not counted
    computing = [l for l in engine.plan.layers if l.tactic_name not in ("kiln.reformat_copy", "kiln.noop")]
    assert len(computing) == 26, [l.name for l in computing]
    (pool,) = [l for l in computing if "GlobalAveragePool" in l.name]
    assert (pool.op_type, pool.precision, pool.outputs[0].dtype) == ("QAveragePool", "INT8", "uint8")
    maxpool = next(l for l in engine.plan.layers if l.op_type == "MaxPool")
    assert maxpool.inputs[0].dtype == "uint8" and maxpool.outputs[0].dtype == "uint8"
    for line in ("QuantizeDoubleInputNodes: Fusing", "VanillaSwapWithFollowingQ: Fusing", "QuantizedAddFusion: Fusing",
                 "QConvEltwiseSumFusion: Fusing"):
        assert line in caplog.text, line
    assert engine.plan.weights[convs[0].args[1].name].dtype == np.int8   # weights stay INT8
    x = np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)
    got, want = engine.run({"input": x})["output"], run_ort(qdq_resnet, {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()
    info = engine.layer_info()
    conv = next(l for l in info["Layers"] if l["Name"] == convs[0].name)
    assert conv["RequestedPrecision"] == conv["GrantedPrecision"] == "INT8"
    quant, model_scales = conv["Quantization"], _weight_scales(qdq_resnet, convs[0].origin)
    assert quant["x_dtype"] == "uint8" and isinstance(quant["x_scale"], float) and quant["x_scale"] > 0
    assert quant["w_scale"] == {"Count": conv["OutMaps"], "Min": float(model_scales.min()),
                                "Max": float(model_scales.max())}   # per channel: its count and range
    channel_major = convs[0].tactic_name.startswith("onednn.")   # where the CPU has VNNI/AMX-INT8
    assert conv["TacticName"] == convs[0].tactic_name
    assert conv["Inputs"][0]["Format/Datatype"] == ("Channel major UInt8 format" if channel_major
                                                    else "Row major linear UInt8 format")
    dq = next(l for l in info["Layers"] if l["Name"].endswith("_DequantizeLinear"))
    assert dq["LayerType"] == "Reformat" and dq["Origin"] == "QDQ"


def _weight_scales(path: str, origin: tuple[str, ...]) -> np.ndarray:
    """The scales the ONNX file gives the weights of the layer made of `origin`: its weight DequantizeLinear's."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.name in origin
             and n.input[0] in inits and inits[n.input[0]].ndim == 4]
    return inits[dq.input[1]]

def test_int8_plan_through_onnxruntime_region_is_exact(qdq_resnet):
    engine = kiln.build(qdq_resnet, avg_timing=1, min_timing=1)
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    got, want = engine.run({"input": x})["output"], run_ort(qdq_resnet, {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()


def test_an_int8_onnxruntime_region_is_fused_by_onnxruntime_as_the_qdq_file_was(qdq_resnet, monkeypatch, tmp_path):
    """kiln hands an INT8 plan to onnxruntime as Q/DQ ONNX again: the folded biases go back as int32
    DequantizeLinear and a fused residual keeps the convolution's own Q -> DQ, so onnxruntime runs every
    convolution as QLinearConv and every sum as QLinearAdd, as for the quantize_static file itself (a float bias
    or an FP32 sum left ResNet-50's region in FP32 between transposes: 43.9 ms against 14.1 standalone)."""
    import collections

    import onnx
    import onnxruntime as ort

    import kiln.planning.race as race

    monkeypatch.setattr(race, "pick_fastest", lambda times, tuner: "onnxruntime")
    engine = kiln.build(qdq_resnet, tactic_sources="-openvino", avg_timing=1, min_timing=1)
    assert [l.tactic_name for l in engine.plan.layers] == ["onnxruntime.region"]
    optimized, real = tmp_path / "region.onnx", ort.InferenceSession

    class Saving(real):
        def __init__(self, model, options=None, *args, **kwargs):
            if isinstance(model, bytes) and options is not None:
                options.optimized_model_filepath = str(optimized)
            super().__init__(model, options, *args, **kwargs)
    monkeypatch.setattr(ort, "InferenceSession", Saving)
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    got = kiln.build(qdq_resnet, tactic_sources="-openvino", avg_timing=1, min_timing=1).run({"input": x})["output"]
    ops = collections.Counter(n.op_type for n in onnx.load(str(optimized), load_external_data=False).graph.node)
    source = collections.Counter(n.op_type for n in onnx.load(qdq_resnet).graph.node)
    assert ops["QLinearConv"] == source["Conv"] and ops["QLinearAdd"] == source["Add"], ops
    assert not {"Conv", "FusedConv", "Add"} & set(ops), ops
    want = run_ort(qdq_resnet, {"input": x})[0]
    assert cosine(got, want) >= 0.9999 and got.argmax() == want.argmax()


def classic_model():
    """Reshape [-1,25088] -> [-1,128,14,14], Q/DQ, 3x3 conv with 12 outputs and no Q after it (TensorRT issue)."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (12, 128, 3, 3)).astype(np.int8)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
             helper.make_node("QuantizeLinear", ["r", "sx", "zx"], ["rq"], name="quant"),
             helper.make_node("DequantizeLinear", ["rq", "sx", "zx"], ["rd"], name="dequant"),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0, name="dequant_w"),
             helper.make_node("Conv", ["rd", "wd", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv")]
    inits = [init("shape", np.array([-1, 128, 14, 14], np.int64)), init("sx", np.array(0.02, np.float32)),
             init("zx", np.array(0, np.int8)), init("w", w), init("sw", rng.uniform(1e-3, 3e-3, 12).astype(np.float32)),
             init("zw", np.zeros(12, np.int8)), init("b", rng.standard_normal(12).astype(np.float32))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 25088])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 (AVX512-BF16 or AMX): --bf16 grants "
                    "nothing here, so there is no budget to check")
def test_bf16_budget_of_a_plan_with_int8_layers_measures_only_what_bf16_adds(qdq_resnet, monkeypatch, caplog):
    """INT8 rounding, here the Q/DQ model's own, which kiln reproduces to onnxruntime's fused-against-unfused
    agreement (on a quantized BERT: cosine 0.992), is not BF16's harm: --bf16's budget compares with kiln's plan
    with every BF16 layer in FP32, not onnxruntime (on that BERT the build failed: "cannot be met even with every
    layer in FP32"). The global pool is kept FP32 (QuantizedPoolFusion off) so that BF16 has a layer to take."""
    from kiln.builder import budget

    def refused(proto):
        def run(inputs):
            raise AssertionError("a self-quantized model's budget ran onnxruntime")
        return run
    monkeypatch.setattr(budget, "onnxruntime_reference", refused)
    caplog.set_level(logging.INFO, logger="kiln.build")
    engine = kiln.build(qdq_resnet, bf16=True, autotune=False, tactic_sources="-openvino,-onnxruntime",
                        disabled_passes=["QuantizedPoolFusion"])
    bf16 = [l for l in engine.plan.layers if l.precision == "BF16"]
    assert bf16 and sum(l.precision == "INT8" for l in engine.plan.layers) >= 20
    assert "the plan's INT8 layers (the model's Q/DQ or --int8's calibration) are in the reference too" in caplog.text
    assert "Accuracy budget cos:0.999 (checked as cos:0.9992) met" in caplog.text


def test_classic_int8_conv_with_fp32_output_is_warned_and_linted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kiln.build")
    model = classic_model()
    profile = {"x": ((1, 25088), (2, 25088), (4, 25088))}
    engine = kiln.build(model, autotune=False, profiles=[profile])
    conv = next(l for l in engine.plan.layers if parameter_type(l) == "Convolution")
    assert conv.precision == "INT8" and conv.inputs[0].dtype == "int8" and conv.outputs[0].dtype == "float32"
    assert "conv runs in INT8 but its output stays FP32" in caplog.text
    assert "Add a QuantizeLinear/DequantizeLinear pair after its output 'y'" in caplog.text
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 25088)).astype(np.float32)
        got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
        assert cosine(got, want) >= 0.9999
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(engine.layer_info()))
    lint = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lint", str(path)], capture_output=True, text=True)
    out = lint.stdout + lint.stderr
    assert "INT8_FLOAT_OUTPUT" in out and conv.name in out
    assert "add a QuantizeLinear/DequantizeLinear pair after" in out


def test_fp16_request_is_recorded_with_its_reason_and_obey_fails(qdq_resnet, tmp_path):
    """The global pool, kept FP32 (QuantizedPoolFusion off), is the float layer --fp16 asks for."""
    engine = kiln.build(qdq_resnet, autotune=False, fp16=True, disabled_passes=["QuantizedPoolFusion"])
    pool = next(l for l in engine.layer_info()["Layers"] if "GlobalAveragePool" in l["Name"])
    assert pool["RequestedPrecision"] == "FP16" and pool["GrantedPrecision"] == "FP32"
    assert "FP16" in pool["PrecisionReason"]
    with pytest.raises(kiln.ModelError, match=r"layer '.*GlobalAveragePool' \(GlobalAveragePool\): --precision-"
                                              r"constraints obey asks for INT8, which kiln cannot give: no INT8 "
                                              r"kernel for GlobalAveragePool"):
        kiln.build(qdq_resnet, autotune=False, layer_precisions={"*": "INT8"}, precision_constraints="obey",
                   disabled_passes=["QuantizedPoolFusion"])
    saved = tmp_path / "e.kiln"
    engine.save(saved)
    again = kiln.load(saved).plan.layers
    assert [(l.requested_precision, l.precision_reason) for l in again] == \
        [(l.requested_precision, l.precision_reason) for l in engine.plan.layers]


def test_quantize_static_detector_concats_run_on_int8_and_silu_chains_fuse(tmp_path, caplog):
    """YOLOv8-shaped detector through quantize_static: Q after Concat splits onto its inputs (the concat runs on
    INT8), DQ -> Sigmoid -> Q -> DQ -> Mul -> Q chains become PointWise layers, and those on a convolution's output
    its output table (QProductTableFusion), and the C2f blocks' Slices of a dequantized SiLU, each quantized again,
    slice the INT8 tensor; the requantizations left before Concats become tables on their inputs, applied by the C
    copy (QConcatTableFusion); the neck's nearest upsamples copy INT8 pixels (VanillaSwapWithFollowingQ): 597 layers
    unfused -> 131, the same bytes as without the tables."""
    from onnxruntime.quantization import QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from tests.models import detectors

    caplog.set_level(logging.DEBUG, logger="kiln.build")
    detectors.export(detectors.make("yolov8"), torch.rand(1, 3, 64, 64), tmp_path / "y.onnx", "legacy")

    quant_pre_process(str(tmp_path / "y.onnx"), str(tmp_path / "pre.onnx"))
    quantize_static(str(tmp_path / "pre.onnx"), str(tmp_path / "q.onnx"),
                    calibration_reader("images", (1, 3, 64, 64), 3, uniform=True), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    engine = kiln.build(str(tmp_path / "q.onnx"), autotune=False)
    layers = engine.plan.layers
    computing = [l for l in layers if l.tactic_name not in ("kiln.reformat_copy", "kiln.noop")]   # layout copies
    assert sum(l.op_type == "QConv" for l in layers) == 64 and len(computing) == 131, len(computing)
    assert [(l.tactic_name, l.precision, l.outputs[0].dtype) for l in layers if l.op_type == "Resize"] == \
        [("kiln.resize_nearest_nhwc", "INT8", "int8")] * 2
    assert [l.outputs[0].dtype for l in layers if l.op_type == "Slice"] == ["int8"] * 18
    tabled = [l for l in layers if "out_table" in l.attrs]
    assert len(tabled) == 61 and all(l.op_type == "QConv" and l.outputs[0].dtype in ("uint8", "int8") for l in tabled)
    assert sum("/act/Sigmoid" in l.name for l in tabled) == 57   # SiLUs; the others requantize for a Concat
    shown = next(d for d in engine.layer_info("detailed")["Layers"] if d["Name"] == tabled[0].name)
    assert shown["ParameterType"] == "Convolution" and shown["OutputTable"]["Count"] == 256
    assert shown["OutputTable"]["Values"] == tabled[0].attrs["out_table"]["bytes"]
    concats = [l for l in layers if l.op_type in ("Concat", "QConcat")]
    assert len(concats) == 19 and all(l.outputs[0].dtype in ("uint8", "int8") for l in concats)
    tables = [t for l in concats if l.op_type == "QConcat" for t in l.attrs["in_tables"] if t is not None]
    assert len(tables) == 24 and all(l.tactic_name == "kiln.copy_rows" for l in concats)
    qconcat = next(l for l in concats if l.op_type == "QConcat")
    shown = next(d for d in engine.layer_info("detailed")["Layers"] if d["Name"] == qconcat.name)
    assert shown["ParameterType"] == "Concatenation" and shown["Axis"] == 1
    assert [t["Values"] for t in shown["InputTables"]] == [t["bytes"] for t in qconcat.attrs["in_tables"] if t]
    assert not [l for l in layers if l.op_type == "PointWise" and l.tactic_name == "kiln.lookup_table" and
                l.outputs[0].dtype in ("uint8", "int8")]   # every INT8 requantization is some layer's table now
    assert "SplitQAcrossPrecedingFanIn: Fusing" in caplog.text
    moves = [(l.precision, l.requested_precision) for l in layers if l.op_type == "Reformat"]
    assert set(moves) <= {("INT8", "")}   # layout copies move INT8 bytes, request nothing (the head's reshapes now
    #                                       read its channel-major maps as they lie: none are left here)
    x = np.random.default_rng(9).random((1, 3, 64, 64)).astype(np.float32)
    got, want = engine.run({"images": x})["output0"], run_ort(str(tmp_path / "q.onnx"), {"images": x})[0]
    assert cosine(got, want) >= 0.999
    apart = kiln.build(str(tmp_path / "q.onnx"), autotune=False,
                       disabled_passes=["QProductTableFusion", "QConcatTableFusion"])
    assert len(apart.plan.layers) == len(layers) + 61 + 24 and np.array_equal(apart.run({"images": x})["output0"], got)


class FakeQuantNet(torch.nn.Module):
    """PyTorch fake-quant (QAT-style) export: per-tensor INT8 activations, per-channel INT8 weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 10)

    @staticmethod
    def act(x, scale):
        return torch.fake_quantize_per_tensor_affine(x, scale, 0, -128, 127)

    @staticmethod
    def weight(m):
        scale = m.weight.detach().abs().amax(dim=tuple(range(1, m.weight.dim()))) / 127
        zero = torch.zeros_like(scale, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(m.weight, scale, zero, 0, -128, 127)

    def forward(self, x):
        x = torch.relu(torch.nn.functional.conv2d(self.act(x, 0.03), self.weight(self.c1), self.c1.bias, padding=1))
        x = torch.nn.functional.conv2d(self.act(x, 0.02), self.weight(self.c2), self.c2.bias, padding=1)
        x = self.act(self.act(x, 0.05).mean((2, 3)), 0.02)
        return torch.nn.functional.linear(x, self.weight(self.fc), self.fc.bias)


def test_pytorch_fake_quant_export_builds_int8_layers(tmp_path, caplog):
    path = tmp_path / "fq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(FakeQuantNet().eval(), (torch.randn(1, 3, 16, 16),), str(path), dynamo=False,
                          opset_version=17, input_names=["x"], output_names=["y"])
    engine = kiln.build(str(path), autotune=False)
    assert [l.op_type for l in engine.plan.layers if l.op_type.startswith("Q")].count("QConv") == 2
    assert any(l.op_type == "QGemm" for l in engine.plan.layers)
    assert "It is a network output" in caplog.text   # the final Gemm writes FP32, as intended
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    got, want = engine.run({"x": x})["y"], run_ort(str(path), {"x": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()


def test_qoperator_format_and_dynamic_quantization_build_and_match(tmp_path):
    """onnxruntime's other two formats: QOperator (QLinearConv/QLinearMatMul, static) on the ResNet, and
    quantize_dynamic (DynamicQuantizeLinear + MatMulInteger) on a BERT-shaped encoder."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    from tests.models import encoders
    from tests.models.nets import export, make

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(make("resnet18"), torch.randn(1, 3, 32, 32), tmp_path / "r.onnx", "legacy")

    quantize_static(str(tmp_path / "r.onnx"), str(tmp_path / "rq.onnx"), calibration_reader("input", (1, 3, 32, 32), 3),
                    quant_format=QuantFormat.QOperator,
                    per_channel=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    engine = kiln.build(str(tmp_path / "rq.onnx"), autotune=False)
    ops = {l.op_type for l in engine.plan.layers}   # unfolded into Q/DQ and fused (kiln.passes.qoperator)
    assert "QConv" in ops and "QLinearConv" not in ops
    got, want = engine.run({"input": x})["output"], run_ort(str(tmp_path / "rq.onnx"), {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.argmax() == want.argmax()

    model = encoders.make("bert")
    feeds = encoders.inputs(model, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoders.export(model, feeds, tmp_path / "b.onnx", "legacy")
        quantize_dynamic(str(tmp_path / "b.onnx"), str(tmp_path / "bq.onnx"), weight_type=QuantType.QInt8)
    for autotune in (False, True):
        engine = kiln.build(str(tmp_path / "bq.onnx"), autotune=autotune, avg_timing=1, min_timing=1)
        got = engine.run(feeds)["last_hidden_state"]
        want = run_ort(str(tmp_path / "bq.onnx"), feeds)[0]
        assert cosine(got, want) >= 0.9999


def test_compare_accepts_int8_rounding_by_cosine_but_not_a_broken_engine(qdq_resnet):
    from kiln.tools.compare import compare

    engine = kiln.build(qdq_resnet, autotune=False)
    report = compare(qdq_resnet, engine)
    assert report.passed and "INT8 rounding" in report.outputs[0].note   # rtol 1e-4 alone would fail INT8
    assert not compare(qdq_resnet, engine, min_cosine=0.9999999).passed


class _Reference:
    """A stand-in for onnxruntime_reference: its outputs, and those of the model run unfused (`literal`)."""

    def __init__(self, unfused):
        self.unfused = unfused

    def __call__(self, inputs):
        return [torch.ones(4), torch.tensor([1, 2])]

    def literal(self, inputs):
        if isinstance(self.unfused, Exception):
            raise self.unfused
        return [self.unfused, torch.tensor([7, -9])]   # integer outputs do not count


@pytest.mark.parametrize("unfused,bar", [
    (torch.ones(4), 0.999),                               # both runs agree: the usual bar
    (torch.tensor([1.0, 1.0, 1.0, 0.8]), None),           # cosine 0.99587: twice its distance from 1
    (torch.tensor([1.0, -1.0, 1.0, -1.0]), 0.95),         # runs that disagree wildly: never below 0.95
    (RuntimeError("no session"), 0.999),                  # the unfused run failed: the usual bar
    (torch.tensor([1.0, float("nan"), 1.0, 1.0]), 0.999),  # NaN says nothing about rounding: the usual bar
    (torch.zeros(4), 0.999)])                             # nor does an all-zero output
def test_a_quantized_models_cosine_bar_is_lowered_to_its_own_rounding_noise(unfused, bar):
    """onnxruntime with and without its fusions round a quantize_static BERT-base to cosine 0.993 of each other;
    a 0.999 bar refused every plan and `kiln build` failed on a model onnxruntime runs."""
    from kiln.planning.race import _rounding_floor

    reference = _Reference(unfused)
    got = _rounding_floor(reference, {}, reference({}), 0.999)
    if bar is None:
        cos = 3.8 / (2 * np.sqrt(3.64))   # the unfused run [1, 1, 1, 0.8] against the fused [1, 1, 1, 1]
        assert got == pytest.approx(1 - 2 * (1 - cos)) and 0.99 < got < 0.992
    else:
        assert got == pytest.approx(bar)


@pytest.fixture(scope="module")
def qdq_encoder(tmp_path_factory):
    """(path, feeds) of a quantize_static BERT-shaped encoder: Q/DQ on every MatMul, Add, LayerNorm and GELU input,
    per-channel weights."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from tests.models import encoders

    folder = tmp_path_factory.mktemp("qdq_encoder")
    model = encoders.make("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoders.export(model, encoders.inputs(model, 1, 32), folder / "b.onnx", "legacy")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([encoders.inputs(model, 1, 32, seed=s) for s in range(2)])

        def get_next(self):
            return next(self.feeds, None)
    quantize_static(str(folder / "b.onnx"), str(folder / "bq.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    return str(folder / "bq.onnx"), encoders.inputs(model, 1, 32, seed=5)


def test_quantize_static_encoder_builds_and_its_plan_agrees_with_onnxruntime(qdq_encoder, monkeypatch):
    """kiln's own plan of the Q/DQ encoder passes the check against onnxruntime (the plan is forced, not timed) and
    runs INT8 layers close to it."""
    from tests.conftest import force_plan

    path, feeds = qdq_encoder
    force_plan(monkeypatch, "kiln")
    engine = kiln.build(path, autotune=False)   # each layer: the first tactic that takes it
    got, want = engine.run(feeds)["last_hidden_state"], run_ort(path, feeds)[0]
    assert cosine(got, want) >= 0.995   # onnxruntime agrees with itself, fused against unfused, to 0.9991 here
    layers = engine.plan.layers
    assert "Region" not in {l.op_type for l in layers}
    products = [l for l in layers if l.op_type == "QMatMul" and l.precision == "INT8"]
    by_weights = [l for l in products if l.args[1].kind == "weight"]
    attention = [l for l in products if l.args[1].kind == "tensor"]   # Q.K^T and P.V: two INT8 activations
    assert (len(by_weights), len(attention), len(products)) == (12, 4, sum(l.op_type == "QMatMul" for l in layers))
    # each head split (Reshape + Transpose of Q, K, V) and merge (Transpose + Reshape of the context) is one INT8
    # Shuffle once their Q/DQ pairs are swapped out of the way, and joins its attention product as steps
    assert not any(l.op_type == "Shuffle" and l.inputs[0].dtype in ("uint8", "int8") for l in layers)
    step_counts = [tuple(len(l.attrs.get(k, [])) for k in ("a_steps", "b_steps", "out_steps")) for l in attention]
    assert step_counts == [(2, 2, 0), (0, 2, 2)] * 2, step_counts   # Q.K^T, then P.V; per encoder layer
    shown = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    assert shown[attention[0].name]["Steps"] == {"A": attention[0].attrs["a_steps"], "B": attention[0].attrs["b_steps"]}
    assert shown[attention[1].name]["Steps"] == {"B": attention[1].attrs["b_steps"],
                                                 "Output": attention[1].attrs["out_steps"]}
    assert not any(l.op_type == "MatMul" for l in layers)
    # each product by weights took its bias Add: rounded to INT8 at the product's own scale first, as the model has it
    assert all("mid_scale" in l.attrs["quant"] and len(l.args) == 3 for l in by_weights)
    # the products' weights are a Transpose of an initializer, which quantize_static quantizes as an activation
    # (with zero points): kiln's INT8 kernels take them, oneDNN's need none
    if vnni_available():
        assert {l.tactic_name for l in by_weights} <= {
            "onednn.qlinear_prepacked", "kiln.qmatmul_gemm_int8", "kiln.qmatmul_gemm_amx_int8"}
        assert {l.tactic_name for l in attention} == {"kiln.qmatmul_act_int8"}
    assert not any(l.op_type == "DequantizeLinear" and all(a.kind == "weight" for a in l.args) for l in layers)
    tables = [l for l in layers if l.op_type == "Gather" and l.args[0].kind == "weight" and
              engine.plan.weights[l.args[0].name].ndim == 2]   # the embeddings, gathered as INT8
    assert tables and all(engine.plan.weights[l.args[0].name].dtype == np.int8 for l in tables)
    if native.available():   # the Q/DQ between them runs in generated kernels (but the mask's Where), and the sums
        pointwise = [l for l in layers if l.op_type == "QAdd" or l.op_type == "PointWise" and
                     "Where" not in {step["op"] for step in l.attrs["program"]}]
        # 4: the embeddings' first sum, per layer the mask's sum, the pooler's Tanh; the residual sums are inside
        # the INT8 LayerNorms below; each embedding table is gathered as INT8 at the scale its sum reads (DQ ->
        # Gather -> Q of equal scales: VanillaSwapWithFollowingQ), no requantization after it
        assert len(pointwise) == 4
        assert {l.tactic_name for l in pointwise if l.op_type == "QAdd"} == {"codegen.pointwise_c_simd"}
        # chains on one INT8 tensor are 256-byte tables: the pooler's Tanh; per layer the scores' scaling and the
        # GELU's Q/DQ-separated ops are tables in their products' epilogues
        lookups = [l for l in pointwise if l.tactic_name == "kiln.lookup_table"]
        assert len(lookups) == 1 and all(sum(a.kind == "tensor" for a in l.args) == 1 for l in lookups)
        tabled = [l for l in products if "out_table" in l.attrs]
        assert [l in attention for l in tabled] == [True, False] * 2   # Q.K^T's scaling, FFN1's GELU
        assert all(l.name.endswith(")") and "PWN(" in l.name for l in tabled)
        table = shown[tabled[0].name]["OutputTable"]
        kind = {"uint8": "UInt8", "int8": "Int8"}[tabled[0].outputs[0].dtype]   # the chain's output type
        assert table == {"Type": kind, "Count": 256, "Values": tabled[0].attrs["out_table"]["bytes"]}
        softmaxes = [l for l in layers if "Softmax" in l.op_type]   # DQ -> Softmax -> Q: INT8 in and out
        assert [(l.op_type, l.tactic_name) for l in softmaxes] == [("QSoftmax", "kiln.softmax_int8")] * 2
        # DQ -> LayerNorm -> Q with the residual QAdd before it: one INT8 layer each (embeddings', 2 per layer)
        norms = [l for l in layers if "Norm" in l.op_type]
        assert [(l.op_type, l.tactic_name, "skip_quant" in l.attrs) for l in norms] == \
            [("QLayerNorm", "kiln.layernorm_rows_int8", True)] * 5
        info = {l["Name"]: l for l in engine.layer_info()["Layers"]}
        for layer in softmaxes + norms:   # their scales, as layer info's kiln addition (TensorRT shows none)
            shown = info[layer.name]
            assert shown["Quantization"] == layer.attrs["quant"] and "quant" not in shown.get("Attributes", {})
            assert shown.get("SkipQuantization") == layer.attrs.get("skip_quant")


def test_a_dynamic_sequence_keeps_the_head_split_in_the_int8_products(tmp_path, monkeypatch):
    """The same encoder exported with a dynamic batch and sequence: the head split and merge (reshape targets with
    0 and -1) still join Q.K^T and P.V as steps, and the plan gives at every shape what the plan with the Shuffles
    as layers of their own gives, bit for bit."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from tests.conftest import force_plan
    from tests.models import encoders

    model = encoders.make("bert")
    encoders.export(model, encoders.inputs(model, 2, 16), tmp_path / "b.onnx", "legacy", dynamic=True)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([encoders.inputs(model, 2, 16, seed=s) for s in range(2)])

        def get_next(self):
            return next(self.feeds, None)
    path = str(tmp_path / "bq.onnx")
    quantize_static(str(tmp_path / "b.onnx"), path, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    force_plan(monkeypatch, "kiln")
    profile = {name: ((1, 4), (1, 16), (2, 32)) for name in model.input_names}
    engine = kiln.build(path, autotune=False, profiles=[profile])
    apart = kiln.build(path, autotune=False, profiles=[profile], disabled_passes=["QMatMulShuffleFusion"])
    attention = [l for l in engine.plan.layers if l.op_type == "QMatMul" and l.args[1].kind == "tensor"]
    step_counts = [tuple(len(l.attrs.get(k, [])) for k in ("a_steps", "b_steps", "out_steps")) for l in attention]
    assert step_counts == [(2, 2, 0), (0, 2, 2)] * 2, step_counts
    assert not any(l.op_type == "Shuffle" and l.inputs[0].dtype in ("uint8", "int8") for l in engine.plan.layers)
    assert len(apart.plan.layers) - len(engine.plan.layers) == 8   # 3 splits and a merge per encoder layer
    if vnni_available():
        assert {l.tactic_name for l in attention} == {"kiln.qmatmul_act_int8"}
    for batch, seq in [(1, 16), (2, 29), (1, 5)]:
        feeds = encoders.inputs(model, batch, seq, seed=seq)
        got = engine.run(feeds)["last_hidden_state"]
        assert got.shape[:2] == (batch, seq)
        np.testing.assert_array_equal(got, apart.run(feeds)["last_hidden_state"])
        assert cosine(got, run_ort(path, feeds)[0]) >= 0.99


def test_an_onnxruntime_region_writes_the_attention_products_steps_back(qdq_encoder, monkeypatch):
    """The Q/DQ encoder handed to onnxruntime as one region: each attention product's steps are written back as
    the Reshape and Transpose around it (kiln.tactics.onnx_emit), and the region agrees with the file."""
    from tests.conftest import force_plan

    path, feeds = qdq_encoder
    force_plan(monkeypatch, "onnxruntime")   # built and checked against the file, then picked
    engine = kiln.build(path, tactic_sources="-openvino", avg_timing=1, min_timing=1)
    assert [l.tactic_name for l in engine.plan.layers] == ["onnxruntime.region"]
    inner = [l for l in engine.plan.layers[0].inner if l.op_type == "QMatMul" and l.attrs.get("b_steps")]
    assert len(inner) == 4
    got, want = engine.run(feeds)["last_hidden_state"], run_ort(path, feeds)[0]
    assert cosine(got, want) >= 0.9999


def test_a_bias_after_the_merged_context_stays_after_the_merge(tmp_path):
    """A Q/DQ attention whose merged context [1, S, H*Dh] gets a bias: the merge joins P.V as out_steps, and the
    bias, of the merged width, is added after them (before, RequantizedBiasFusion could add it to the product
    before its steps, and the run failed on mismatched widths)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    s, h, d = 8, 2, 4
    rng = np.random.default_rng(0)
    split, merged = init("split", np.array([1, s, h, d], np.int64)), init("merged", np.array([1, s, h * d], np.int64))
    mk = helper.make_node
    nodes = [mk("Reshape", ["q", "split"], ["qr"]), mk("Transpose", ["qr"], ["qh"], perm=[0, 2, 1, 3]),
             mk("Reshape", ["k", "split"], ["kr"]), mk("Transpose", ["kr"], ["kt"], perm=[0, 2, 3, 1]),
             mk("Reshape", ["v", "split"], ["vr"]), mk("Transpose", ["vr"], ["vh"], perm=[0, 2, 1, 3]),
             mk("MatMul", ["qh", "kt"], ["scores"]), mk("Softmax", ["scores"], ["p"], axis=-1),
             mk("MatMul", ["p", "vh"], ["c"]), mk("Transpose", ["c"], ["ct"], perm=[0, 2, 1, 3]),
             mk("Reshape", ["ct", "merged"], ["cm"]), mk("Add", ["cm", "bias"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, s, h * d]) for n in "qkv"],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, s, h * d])],
                       [split, merged, init("bias", rng.standard_normal(h * d).astype(np.float32))])
    batches = [{n: rng.standard_normal((1, s, h * d)).astype(np.float32) for n in "qkv"} for _ in range(3)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(batches[:2])

        def get_next(self):
            return next(self.feeds, None)
    import onnx

    onnx.save(model, str(tmp_path / "att.onnx"))
    quantize_static(str(tmp_path / "att.onnx"), str(tmp_path / "att_q.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    engine = kiln.build(str(tmp_path / "att_q.onnx"), autotune=False, tactic_sources="-openvino,-onnxruntime")
    context = [l for l in engine.plan.layers if l.op_type == "QMatMul" and l.attrs.get("out_steps")]
    assert len(context) == 1 and len(context[0].args) == 2   # P.V with the merge; no bias inside
    got, want = engine.run(batches[2])["y"], run_ort(str(tmp_path / "att_q.onnx"), batches[2])[0]
    assert cosine(got, want) >= 0.999
