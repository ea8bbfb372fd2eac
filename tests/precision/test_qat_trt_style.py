"""TensorRT-style QAT exports (pytorch-quantization, ModelOpt): Q/DQ only on each convolution's input and weights,
BatchNormalization kept after the convolution, the residual Add and ReLU left in FP32. Each convolution becomes
one INT8 QConv on kiln's kernels with its BatchNorm folded into the weights' dequantization scales, its FP32
residual sum and ReLU in the epilogue; before, every BatchNorm (and with it the sum and ReLU) ran as a PointWise
layer of its own, most on the reference kernel."""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

import kiln
from kiln.tactics.qgemm_c import vnni_available
from tests.conftest import assert_close_to_ort, cosine, run_ort
from tests.models import nets
from tests.models.qat import fake_quantize

KILN_INT8 = {"kiln.qconv2d_1x1_gemm_nhwc_int8", "kiln.qconv2d_direct_nhwc_int8", "kiln.qconv2d_1x1_gemm_nhwc_amx_int8",
             "kiln.qconv2d_direct_nhwc_amx_int8", "onednn.qconv2d_nhwc_prepacked", "onednn.qconv2d_primitive"}


@pytest.fixture(scope="module")
def qat_resnet18(tmp_path_factory) -> str:
    """A fake-quantized ResNet-18 at 32x32, some BatchNorm scales negative (the fold must flip those channels)."""
    model = nets.make("resnet18", seed=3)
    with torch.no_grad():
        for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.weight[::5] *= -1
    model = fake_quantize(model, torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    path = tmp_path_factory.mktemp("qat") / "r18_qat.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.rand(1, 3, 32, 32),), str(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"])
    return str(path)


def test_each_convolution_is_one_int8_layer_with_its_batchnorm_sum_and_relu(qat_resnet18):
    """Exact layers on kiln's kernels (autotune off: each on the first tactic that takes it), and onnxruntime's
    output to 1e-4 of its largest value on the INT8 kernels (exact sums; no requantization lands on a tie here).
    Without VNNI the reference QConv requantizes from float64 sums, some values a step apart: a cosine there."""
    ops = Counter(n.op_type for n in onnx.load(qat_resnet18).graph.node)   # the recipe: 21 layers x 2 DQs
    assert (ops["Conv"], ops["BatchNormalization"], ops["Add"], ops["DequantizeLinear"]) == (20, 20, 8, 42)
    engine = kiln.build(qat_resnet18, tactic_sources="-openvino,-onnxruntime", autotune=False)
    layers = engine.plan.layers
    kinds = Counter(l.op_type for l in layers)
    assert kinds["QConv"] == 20 and kinds["QGemm"] == 1
    assert not {"BatchNormalization", "PointWise", "Conv", "Add", "Relu"} & set(kinds)
    convs = [l for l in layers if l.op_type == "QConv"]
    assert all("BatchNormalization" in l.name and l.precision == "INT8" for l in convs)
    summed = [l for l in convs if len(l.inputs) == 2]   # the INT8 input and the FP32 residual
    assert len(summed) == 8 and all(l.inputs[1].dtype == "float32" and "/Add" in l.name for l in summed)
    # a block ending a stage writes INT8 for the next stage's convolutions; the others write FP32, read twice
    assert Counter(l.outputs[0].dtype for l in summed) == Counter(float32=5, int8=3)
    if vnni_available():
        # an FP32 residual: oneDNN's sum post-op adds INT8 ones only
        assert {l.tactic_name for l in summed} <= KILN_INT8 - {"onednn.qconv2d_nhwc_prepacked",
                                                               "onednn.qconv2d_primitive"}
        assert all(l.tactic_name in KILN_INT8 for l in convs)
    x = {"input": np.random.default_rng(0).random((1, 3, 32, 32), np.float32)}
    got, want = engine.run(x)["output"], run_ort(qat_resnet18, x)[0]
    if vnni_available():
        assert_close_to_ort(got, want)
    else:
        assert cosine(got, want) > 0.9999


def test_an_onnxruntime_region_gets_the_folded_convolutions_back_as_qdq(qat_resnet18, monkeypatch):
    """The fused layers emitted for onnxruntime (DQ -> Conv with the folded, sign-flipped filter -> + residual ->
    ReLU [-> Q]) compute what the model computes. A convolution writing INT8 goes to onnxruntime as DQ -> Conv -> Q,
    which it runs as QLinearConv (the model's Conv -> BatchNorm -> ReLU -> Q it runs in FP32): its requantization
    rounds some values a step apart from the model's, hence a cosine, not 1e-4."""
    from tests.conftest import force_plan

    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(qat_resnet18, tactic_sources="onnxruntime")
    assert [l.op_type for l in engine.plan.layers] == ["Region"]
    x = {"input": np.random.default_rng(1).random((1, 3, 32, 32), np.float32)}
    assert cosine(engine.run(x)["output"], run_ort(qat_resnet18, x)[0]) > 0.9999
