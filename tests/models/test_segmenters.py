"""The segmentation U-Net (tests/models/segmenters.py), exported by torch's legacy exporter: every GroupNorm (an
InstanceNormalization between Reshapes, then Mul, Add) and the SiLU after it are one GroupNormalization layer;
kiln's own kernels match onnxruntime in FP32; under --bf16 every GroupNorm and every ConvTranspose is granted BF16
on kiln's kernels, no layer stays FP32 for want of a BF16 kernel, and the bilinear upsample of the logits runs on
kiln's interpolation kernel."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import kiln
from kiln.tactics import codegen
from kiln.tactics.onednn_conv import bf16_available
from tests.conftest import assert_close_to_ort, cosine, run_ort
from tests.models.nets import export
from tests.models.segmenters import make_unet

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
OWN = "-openvino,-onnxruntime"


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet") / "unet.onnx"
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    export(make_unet(width=16), x, path, "legacy")
    return onnx.load(str(path)), {"input": x.numpy()}


def test_own_kernels_match_onnxruntime(unet):
    path, feeds = unet
    engine = kiln.build(path, tactic_sources="kiln,codegen,torch-onednn", avg_timing=1, min_timing=1)
    assert_close_to_ort(engine.run(feeds)["output"], run_ort(path, feeds)[0])
    layers = engine.plan.layers
    norms = [layer for layer in layers if layer.op_type == "GroupNormalization"]
    assert len(norms) == 14 and not [layer for layer in layers if layer.op_type in ("InstanceNormalization",
                                                                                    "PointWise", "Swish")]
    assert all(n.attrs["activation"]["op"] == "Swish" and n.name.endswith("Sigmoid + " + n.origin[-1]) for n in norms)
    assert {n.tactic_name for n in norms} <= {"kiln.groupnorm_rows", "kiln.groupnorm_nhwc"}
    assert next(layer.tactic_name for layer in layers if layer.op_type == "Resize") == "kiln.resize_interpolate"


@pytest.mark.skipif(not bf16_available(), reason="no native BF16 (avx512_bf16/amx_bf16) with oneDNN here")
def test_bf16_is_granted_to_group_norms_and_transposed_convolutions(unet):
    path, feeds = unet
    engine = kiln.build(path, bf16=True, tactic_sources=OWN, precision_constraints="prefer", accuracy="off",
                        avg_timing=1, min_timing=1)   # BF16 wherever a kernel exists, whatever tiny layers time
    layers = engine.plan.layers
    norms = [(l.tactic_name.removeprefix("kiln.groupnorm_").removesuffix("_nhwc_bf16"), l.precision)
             for l in layers if l.op_type == "GroupNormalization"]
    ups = [(l.tactic_name, l.precision) for l in layers if l.op_type == "ConvTranspose"]
    assert len(norms) == 14 and {precision for _, precision in norms} == {"BF16"}   # two a block, seven blocks
    assert {tactic for tactic, _ in norms} <= {"rows_bf16", "nhwc_bf16"}
    assert ups == [("onednn.deconv2d_nhwc_prepacked_bf16", "BF16")] * 3
    reasons = [l.get("PrecisionReason", "") for l in engine.layer_info()["Layers"]]
    assert not [r for r in reasons if "no BF16 kernel" in r]
    got, want = engine.run(feeds)["output"], run_ort(path, feeds)[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999
