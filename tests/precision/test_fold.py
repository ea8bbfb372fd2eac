"""BatchNormalization folded into the Conv before it on the ONNX model (kiln.preprocess.fold), ahead of implicit
INT8 calibration: the folded model computes what onnxruntime computes on the original, and what cannot be folded
(a Conv output read twice, training mode, a graph output in between) is left alone."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kiln.preprocess.fold import fold_batch_norms
from tests.conftest import init, make_model, rand, run_ort


def bn_inits(prefix: str, channels: int, seed: int) -> list:
    return [init(f"{prefix}_g", rand((channels,), seed, positive=True)), init(f"{prefix}_b", rand((channels,), seed + 1)),
            init(f"{prefix}_m", rand((channels,), seed + 2) * 0.2), init(f"{prefix}_v", rand((channels,), seed + 3,
                                                                                            positive=True))]


def model(second_reader: bool = False, training: int = 0, shared_weight: bool = True):
    """x -> conv1(w, no bias) -> bn1 -> relu -> conv2(w2 or w, bias) -> bn2 -> y (conv1's output also read by
    `second_reader`)."""
    h = helper.make_node
    nodes = [h("Conv", ["x", "w"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             h("BatchNormalization", ["c1", "bn1_g", "bn1_b", "bn1_m", "bn1_v"], ["n1"], name="bn1", epsilon=1e-3,
               **({"training_mode": training} if training else {})),
             h("Relu", ["n1"], ["r"], name="relu"),
             h("Conv", ["r", "w" if shared_weight else "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             h("BatchNormalization", ["c2", "bn2_g", "bn2_b", "bn2_m", "bn2_v"], ["y"], name="bn2")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])]
    if second_reader:
        nodes.append(h("Sigmoid", ["c1"], ["side"], name="side"))
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, 4, 8, 8]))
    inits = [init("w", rand((4, 4, 3, 3), 1) * 0.3), init("w2", rand((4, 4, 3, 3), 2) * 0.3),
             init("b2", rand((4,), 3)), *bn_inits("bn1", 4, 10), *bn_inits("bn2", 4, 20)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])], outputs, inits)


@pytest.mark.parametrize("shared_weight", [True, False])
def test_folded_model_matches_the_original_in_onnxruntime(shared_weight):
    original = model(shared_weight=shared_weight)
    folded = fold_batch_norms(original)
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Relu", "Conv"]
    assert [n.output[0] for n in folded.graph.node] == ["n1", "r", "y"]   # the Conv takes the BN's output name
    assert [[(p.key, p.value) for p in n.metadata_props] for n in folded.graph.node] == \
        [[("kiln.folded_nodes", "bn1")], [], [("kiln.folded_nodes", "bn2")]]
    assert {t.name for t in folded.graph.initializer} == {"conv1_bn_folded_weight", "conv1_bn_folded_bias",
                                                          "conv2_bn_folded_weight", "conv2_bn_folded_bias"}
    x = {"x": rand((1, 4, 8, 8), 7)}
    np.testing.assert_allclose(run_ort(folded, x)[0], run_ort(original, x)[0], rtol=1e-4, atol=1e-5)
    assert len(original.graph.node) == 5   # the input model is not modified


def test_a_conv_output_read_elsewhere_or_a_training_mode_bn_is_not_folded():
    kept = fold_batch_norms(model(second_reader=True))
    assert [n.op_type for n in kept.graph.node] == ["Conv", "BatchNormalization", "Relu", "Conv", "Sigmoid"]
    assert [n.name for n in kept.graph.node if n.op_type == "BatchNormalization"] == ["bn1"]
    training = fold_batch_norms(model(training=1))
    assert [n.name for n in training.graph.node if n.op_type == "BatchNormalization"] == ["bn1"]
