"""onnxruntime's quantize_static with options other than its defaults, on a ResNet-18 at 32x32: symmetric INT8
activations (each ReLU quantized at its own scale, a table in its convolution's epilogue) and INT4 weights (written as
com.microsoft Q/DQ below opset 21, run on the INT8 kernels). Outputs against onnxruntime on the same file."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import kiln
from tests.conftest import cosine, run_ort
from tests.precision.test_qdq import calibration_reader

SHAPE = (1, 3, 32, 32)


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from tests.models.nets import export, make

    folder = tmp_path_factory.mktemp("variants")
    export(make("resnet18", seed=0), torch.randn(SHAPE), folder / "r.onnx", "legacy")
    quant_pre_process(str(folder / "r.onnx"), str(folder / "pre.onnx"))
    return folder


def quantized(folder, name: str, **options) -> str:
    from onnxruntime.quantization import QuantFormat, quantize_static

    path = str(folder / f"{name}.onnx")
    quantize_static(str(folder / "pre.onnx"), path, calibration_reader("input", SHAPE, 3), quant_format=QuantFormat.QDQ,
                    per_channel=True, **options)
    return path


def computing(engine: kiln.Engine) -> list:
    """The plan's layers less copies between layouts (CPUs without VNNI run INT8 convolutions channel-major, on
    torch's reference kernel, and copy to and from them)."""
    return [l for l in engine.plan.layers if l.tactic_name not in ("kiln.reformat_copy", "kiln.noop")]


def built_and_compared(path: str) -> kiln.Engine:
    engine = kiln.build(path, int8=True, autotune=False, tactic_sources="-openvino,-onnxruntime")
    x = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
    got, want = engine.run({"input": x})["output"], run_ort(path, {"input": x})[0]
    assert cosine(got, want) >= 0.999 and got.shape == want.shape   # INT8 roundings a step apart here and there
    return engine


def test_symmetric_activations_put_each_relus_own_quantization_in_its_convolution(preprocessed):
    """ActivationSymmetric: a convolution's output and the ReLU after it get different s8 scales, so quantize_static
    writes Conv -> Q -> DQ -> Relu -> Q; the DQ -> Relu -> Q chain (a table of 256 bytes) joins the convolution: the
    same 26 layers as the default recipe (43 with the chains apart). The last one, read by the INT8 global pool, is
    a table too."""
    from onnxruntime.quantization import QuantType

    path = quantized(preprocessed, "symmetric", activation_type=QuantType.QInt8,
                     extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    engine = built_and_compared(path)
    layers = engine.plan.layers
    convs = [l for l in layers if l.op_type == "QConv"]
    assert len(computing(engine)) == 26 and len(convs) == 20
    assert not [l for l in layers if l.op_type == "PointWise"]
    tabled = [l for l in convs if "out_table" in l.attrs]
    assert len(tabled) == 17 and all("Relu" in l.name and l.precision == "INT8" for l in tabled)
    apart = kiln.build(path, int8=True, autotune=False, tactic_sources="-openvino,-onnxruntime",
                       disabled_passes=["QProductTableFusion"])
    x = np.random.default_rng(6).standard_normal(SHAPE).astype(np.float32)
    assert len(computing(apart)) == 43 and np.array_equal(apart.run({"input": x})["output"],
                                                           engine.run({"input": x})["output"])


def test_int4_weights_in_contrib_qdq_run_on_the_int8_kernels(preprocessed):
    """weight_type=QInt4 below opset 21: quantize_static writes com.microsoft QuantizeLinear/DequantizeLinear (INT4
    weights, u8 activations); kiln reads them as the standard ops and each convolution is one INT8 layer (INT4 values
    are INT8 values)."""
    from onnxruntime.quantization import QuantType

    path = quantized(preprocessed, "int4", weight_type=QuantType.QInt4)
    proto = onnx.load(path)
    assert {n.domain for n in proto.graph.node if n.op_type.endswith("QuantizeLinear")} == {"com.microsoft"}
    assert any(t.data_type == onnx.TensorProto.INT4 for t in proto.graph.initializer)
    engine = built_and_compared(path)
    convs = [l for l in engine.plan.layers if l.op_type == "QConv"]
    assert len(computing(engine)) == 26 and len(convs) == 20 and all(l.precision == "INT8" for l in convs)


@pytest.mark.parametrize("activations,weights", [("QUInt16", "QInt8"), ("QInt16", "QInt16")])
def test_sixteen_bit_quantization_is_emulated_in_fp32_on_the_float_kernels(preprocessed, activations, weights,
                                                                          tmp_path):
    """16-bit activations (opset 21 Q/DQ; onnxruntime's A16W8 and A16W16 recipes): kiln has no 16-bit integer
    kernels (TensorRT has no such type), so no quantized layer is formed: the convolutions run FP32 on dequantized
    weights, each Q -> DQ round trip is one generated FP32 layer rounding to the 16-bit grid, every layer is FP32 (no
    INT8 label), and no 16-bit tensor is stored between layers (a max pooling between a 16-bit DQ and Q runs on
    the floats). The engine saves and loads."""
    from onnxruntime.quantization import QuantType

    path = quantized(preprocessed, activations, activation_type=getattr(QuantType, activations),
                     weight_type=getattr(QuantType, weights))
    engine = kiln.build(path, autotune=False, tactic_sources="-openvino,-onnxruntime")
    layers = engine.plan.layers
    assert not any(l.op_type.startswith("Q") and l.domain == "kiln" for l in layers)
    assert sum(l.op_type == "Conv" and l.precision == "FP32" for l in layers) == 20
    assert all(l.precision == "FP32" and l.requested_precision in ("FP32", "") for l in layers)   # "": reformats
    round_trips = [l for l in layers if l.op_type == "PointWise"]
    assert round_trips and all(l.tactic_name == "codegen.pointwise_c_simd" for l in round_trips)
    engine.save(tmp_path / "e.kiln")
    x = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
    got, want = kiln.load(tmp_path / "e.kiln").run({"input": x})["output"], run_ort(path, {"input": x})[0]
    assert cosine(got, want) >= 0.99999
    stored = {d["Format/Datatype"] for layer in engine.layer_info("detailed")["Layers"] for d in layer["Outputs"]}
    assert stored == {"Channel major FP32 format", "Row major linear FP32"}, stored
