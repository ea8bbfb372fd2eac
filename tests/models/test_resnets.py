"""Model-level tests: ResNet-18 / ResNet-50 exported by both torch exporters, built by kiln, checked against
onnxruntime, with the fusion result pinned (BN folding, conv + add + relu residual fusion, exact layer counts).

Each (model, exporter) case is exported and built once per module (per xdist worker) by the `case` fixture.
Images are small (ResNet-18 96x96, ResNet-50 64x64): the layer counts do not depend on the image size.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch

import kiln
from tests.conftest import assert_close_to_ort, run_ort
from tests.models.nets import export, make
from kiln.trt.vocab import parameter_type

IMAGE = {"resnet18": 96, "resnet50": 64}

# These structure tests build with autotune=False (builder optimization level 0), so the plan does not depend on
# kernel timings: every conv takes its first eligible kernel (oneDNN), every other layer the torch reference.
# Exact plan layer counts, by ParameterType. Both exporters give the same totals (25 and 58), via different layers:
#
#   ResNet-18: 20 Convolution = stem 7x7 + 8 BasicBlocks x 2 convs + 3 downsample 1x1 convs,
#              every BatchNormalization folded into its conv, all 17 Relus and all 8 residual Adds fused
#              into convs (no PointWise layer left);
#            + 1 MaxPool + 1 global average pool + 1 Shuffle (flatten) + 1 Gemm (MatrixMultiply)
#            + 1 Reformat (linear -> hwc before the stem conv; the flatten Shuffle reads the pooled [1, C, 1, 1]
#              as it lies, a view)
#            = 25.
#   ResNet-50: 53 Convolution = stem + 16 Bottlenecks x 3 convs + 4 downsample convs (49 Relus, 16 Adds fused)
#            + the same 5 head/stem layers = 58.
#
# Why the exporters differ layer-by-layer but not in total:
#   * legacy (TorchScript, opset 17, no constant folding) writes Conv + BatchNormalization pairs; kiln's
#     ConvScaleFusion folds each BN, so layer names read "<conv> + <bn>[ + <add>] + <relu>". The pool is
#     GlobalAveragePool -> a Pooling layer; the flatten is a Flatten node -> Shuffle.
#   * dynamo (torch.export, opset 20) already folds BN into the conv weights/bias during export, so the ONNX has
#     no BatchNormalization at all and the downsample convs (conv + BN only) come out as bare "node_Conv_N" layers
#     with nothing left to fuse. The pool is ReduceMean(axes=[-2, -1], keepdims=1) -> a Reduce layer (kiln does
#     not rewrite it to a Pooling layer); the flatten is a Reshape -> Shuffle.
#   The legacy graph has 69 nodes for ResNet-18 (175 for ResNet-50) against 49 (122) from dynamo; after BN
#   folding and conv + add + relu fusion both collapse to the same plan size.
EXPECTED = {
    ("resnet18", "legacy"): Counter(Convolution=20, Pooling=2, Shuffle=1, MatrixMultiply=1, Reformat=1),   # 25
    ("resnet18", "dynamo"): Counter(Convolution=20, Pooling=1, Reduce=1, Shuffle=1, MatrixMultiply=1, Reformat=1),
    ("resnet50", "legacy"): Counter(Convolution=53, Pooling=2, Shuffle=1, MatrixMultiply=1, Reformat=1),   # 58
    ("resnet50", "dynamo"): Counter(Convolution=53, Pooling=1, Reduce=1, Shuffle=1, MatrixMultiply=1, Reformat=1),
}
TOTAL = {("resnet18", "legacy"): 25, ("resnet18", "dynamo"): 25, ("resnet50", "legacy"): 58, ("resnet50", "dynamo"): 58}
RELUS = {"resnet18": 17, "resnet50": 49}             # Relu nodes in the network, all fused into convs
RESIDUALS = {"resnet18": 8, "resnet50": 16}          # one conv + add + relu per block
DOWNSAMPLES = {"resnet18": 3, "resnet50": 4}         # 1x1 conv + BN shortcut convs

CASES = [("resnet18", "legacy"), ("resnet18", "dynamo"), ("resnet50", "legacy"), ("resnet50", "dynamo")]


@dataclass
class Case:
    name: str
    exporter: str
    path: str
    model: onnx.ModelProto
    x: np.ndarray
    engine: object
    ort_out: np.ndarray


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export + build cache for this module: each case is exported to ONNX and built by kiln at most once."""
    cache: dict[tuple[str, str], Case] = {}
    root = tmp_path_factory.mktemp("resnets")

    def get(name: str, exporter: str) -> Case:
        if (name, exporter) not in cache:
            hw = IMAGE[name]
            net = make(name, seed=0)
            path = root / f"{name}_{exporter}.onnx"
            export(net, torch.randn(1, 3, hw, hw, generator=torch.Generator().manual_seed(1)), path, exporter)
            model = onnx.load(str(path))
            x = np.random.default_rng(2).standard_normal((1, 3, hw, hw)).astype(np.float32)
            cache[name, exporter] = Case(name, exporter, str(path), model, x, kiln.build(str(path), autotune=False),
                                         run_ort(str(path), {"input": x})[0])
        return cache[name, exporter]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{e}" for n, e in CASES])
def case(request, exported) -> Case:
    return exported(*request.param)


def convs(case: Case):
    return [l for l in case.engine.plan.layers if parameter_type(l) == "Convolution"]


def is_residual(layer) -> bool:
    """conv + add (+ activation): the Add's other operand rides along as a 4th, activation-tensor argument."""
    return len(layer.args) == 4 and layer.args[3].kind == "tensor"


def test_matches_onnxruntime(case):
    out = case.engine.run({"input": case.x})["output"]
    assert out.shape == (1, 1000)
    assert_close_to_ort(out, case.ort_out, rel=1e-4)


def test_exported_graph_shape(case):
    """What each exporter hands kiln (guards the comments above against torch changing its exporters)."""
    ops = Counter(n.op_type for n in case.model.graph.node)
    n_conv = EXPECTED[case.name, case.exporter]["Convolution"]
    assert ops["Conv"] == n_conv and ops["Relu"] == RELUS[case.name] and ops["Add"] == RESIDUALS[case.name]
    if case.exporter == "legacy":
        assert ops["BatchNormalization"] == n_conv and ops["GlobalAveragePool"] == 1 and ops["Flatten"] == 1
    else:
        assert ops["BatchNormalization"] == 0 and ops["ReduceMean"] == 1 and ops["Reshape"] == 1


def test_batchnorm_and_relu_fused(case):
    layers = case.engine.plan.layers
    assert not [l.name for l in layers if l.op_type in ("BatchNormalization", "Relu", "Add")]
    assert not [l.name for l in layers if parameter_type(l) in ("PointWise", "Scale", "ElementWise", "Activation")]
    if case.exporter == "legacy":
        # every conv absorbed its BatchNormalization, visible in the fused name and the origin
        for l in convs(case):
            assert " + " in l.name and "BatchNormalization" in l.name, l.name
            assert l.origin[0].endswith("/Conv") and l.origin[1].endswith("/BatchNormalization"), l.origin
    else:
        # BN was folded by the exporter; all convs but the downsample shortcuts fused a Relu (and maybe an Add)
        bare = [l for l in convs(case) if " + " not in l.name]
        assert len(bare) == DOWNSAMPLES[case.name], [l.name for l in bare]
        assert all(l.attrs["kernel_shape"] == [1, 1] for l in bare)   # stride 2, or 1 in ResNet-50 layer1
    # every Relu of the network ended up as a conv's fused activation
    activated = [l for l in convs(case) if l.attrs.get("activation", {}).get("op") == "Relu"]
    assert len(activated) == RELUS[case.name]


def test_residual_blocks_fuse_conv_add_relu(case):
    fused = [l for l in convs(case) if is_residual(l) and "activation" in l.attrs]
    assert len(fused) == RESIDUALS[case.name], [l.name for l in fused]
    for l in fused:
        assert l.attrs["activation"]["op"] == "Relu"
        assert l.name.count(" + ") >= 2, l.name                    # conv [+ bn] + add + relu
        assert len(l.origin) == (4 if case.exporter == "legacy" else 3), l.origin
    # no residual conv without its Relu
    assert all("activation" in l.attrs for l in convs(case) if is_residual(l))


def test_exact_layer_count(case):
    layers = case.engine.plan.layers
    kinds = Counter(parameter_type(l) for l in layers)
    assert kinds == EXPECTED[case.name, case.exporter], kinds
    assert len(layers) == TOTAL[case.name, case.exporter]
    reformats = [l for l in layers if parameter_type(l) == "Reformat"]
    assert [l.attrs.get("target_format") for l in reformats] == ["hwc"]


def test_save_load_round_trip(exported, tmp_path):
    c = exported("resnet18", "legacy")
    out = c.engine.run({"input": c.x})["output"]
    path = tmp_path / "resnet18.kiln"
    c.engine.save(path)
    again = kiln.load(path)
    assert [l.name for l in again.plan.layers] == [l.name for l in c.engine.plan.layers]
    np.testing.assert_array_equal(again.run({"input": c.x})["output"], out)
