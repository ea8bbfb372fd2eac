"""Fusion passes: which layers the engine ends up with, their TensorRT-style names, and why fusions did not fire."""
import logging

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.frontend import import_onnx
from kiln.passes.conv import fold_batchnorm_into_conv, fuse_activation
from kiln.passes.manager import PassLog
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort
from kiln.trt.vocab import parameter_type

F32 = TensorProto.FLOAT


def vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def build_and_check(model, feeds, **opts):
    opts.setdefault("autotune", False)   # these tests pin the passes' result, not timing-dependent kernel choices
    engine = kiln.build(model, **opts)
    got = engine.run(feeds)
    for out, exp in zip(model.graph.output, run_ort(model, feeds)):
        assert_close_to_ort(got[out.name], exp)
    return engine


def names(engine):
    return [l.name for l in engine.plan.layers]


def op_types(engine):
    return [l.op_type for l in engine.plan.layers]


CONV_INITS = [init("w", rand((4, 4, 3, 3), 1)), init("b", rand(4, 2))]
BN_INITS = [init("s", rand(4, 3)), init("bb", rand(4, 4)), init("m", rand(4, 5)), init("v", rand(4, 6, True))]
X = rand((1, 4, 6, 6), 7)


def conv(out="c", inp="x", name="conv"):
    return helper.make_node("Conv", [inp, "w", "b"], [out], name=name, pads=[1, 1, 1, 1])


def conv_model(tail, outputs=(("y", [1, 4, 6, 6]),), extra_inits=(), extra_inputs=()):
    nodes = [conv()] + tail
    return make_model(nodes, [vi("x", [1, 4, 6, 6])] + list(extra_inputs), [vi(n, s) for n, s in outputs],
                      CONV_INITS + list(extra_inits))


# ---------------------------------------------------------------- convolution fusions
def test_conv_bn_fold():
    bn = helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], name="bn")
    engine = build_and_check(conv_model([bn], extra_inits=BN_INITS), {"x": X})
    assert "BatchNormalization" not in op_types(engine)
    conv_layers = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert [l.name for l in conv_layers] == ["conv + bn"]
    assert conv_layers[0].origin == ("conv", "bn")


def test_conv_bn_fold_disabled_keeps_bn():
    bn = helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], name="bn")
    engine = build_and_check(conv_model([bn], extra_inits=BN_INITS), {"x": X}, disabled_passes={"ConvScaleFusion"})
    assert "BatchNormalization" in op_types(engine)


def test_conv_bn_fold_direct_pass_call():
    bn = helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], name="bn")
    g = import_onnx(conv_model([bn], extra_inits=BN_INITS))
    plog = PassLog("ConvScaleFusion")
    fold_batchnorm_into_conv(g, plog)
    assert plog.matches == 1
    assert [n.op_type for n in g.nodes] == ["Conv"]
    assert "conv + bn" in str(g)


def test_conv_relu():
    engine = build_and_check(conv_model([helper.make_node("Relu", ["c"], ["y"], name="relu")]), {"x": X})
    conv_layers = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert [l.name for l in conv_layers] == ["conv + relu"]
    assert conv_layers[0].origin == ("conv", "relu")
    assert "Relu" not in op_types(engine)


def test_conv_bn_relu_three_way():
    tail = [helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["n"], name="bn"),
            helper.make_node("Relu", ["n"], ["y"], name="relu")]
    engine = build_and_check(conv_model(tail, extra_inits=BN_INITS), {"x": X})
    assert [l.name for l in engine.plan.layers if parameter_type(l) == "Convolution"] == ["conv + bn + relu"]


def test_conv_residual_add_relu_is_one_layer():
    tail = [helper.make_node("Add", ["c", "x"], ["s1"], name="add"), helper.make_node("Relu", ["s1"], ["y"], name="relu")]
    engine = build_and_check(conv_model(tail), {"x": X})
    conv_layers = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert [l.name for l in conv_layers] == ["conv + add + relu"]
    assert conv_layers[0].origin == ("conv", "add", "relu")
    assert not {"Add", "Relu"} & set(op_types(engine))


def test_residual_not_fused_when_shapes_differ(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    tail = [helper.make_node("Add", ["c", "r"], ["s1"], name="add"), helper.make_node("Relu", ["s1"], ["y"], name="relu")]
    model = conv_model(tail, extra_inputs=[vi("r", [1, 4, 1, 6])])
    engine = build_and_check(model, {"x": X, "r": rand((1, 4, 1, 6), 3)})
    assert "Add" in op_types(engine) or any("add" in l.origin and l.op_type == "PointWise" for l in engine.plan.layers)
    assert "conv + add" not in " ".join(names(engine))
    lines = [r.getMessage() for r in caplog.records if "Not fusing conv with add" in r.getMessage()]
    assert lines and "shapes differ" in lines[0], caplog.text


def test_conv_with_two_consumers_not_fused_with_relu(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    tail = [helper.make_node("Relu", ["c"], ["y"], name="relu"), helper.make_node("Sigmoid", ["c"], ["z"], name="sig")]
    model = conv_model(tail, outputs=(("y", [1, 4, 6, 6]), ("z", [1, 4, 6, 6])))
    engine = build_and_check(model, {"x": X})
    assert [l.name for l in engine.plan.layers if parameter_type(l) == "Convolution"] == ["conv"]
    assert "ConvReluFusion: Not fusing conv with relu" in caplog.text
    assert "2 consumers" in caplog.text


@pytest.mark.parametrize("operands", [["c", "s1"], ["s1", "c"]], ids=["x*sig", "sig*x"])
def test_conv_silu_is_one_layer_with_a_swish_activation(operands):
    tail = [helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["n"], name="bn"),
            helper.make_node("Sigmoid", ["n"], ["s1"], name="sig"),
            helper.make_node("Mul", [o.replace("c", "n") for o in operands], ["y"], name="mul")]
    engine = build_and_check(conv_model(tail, extra_inits=BN_INITS), {"x": X})
    convs = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert [l.name for l in convs] == ["conv + bn + sig + mul"] and {"Sigmoid", "Mul", "PointWise"}.isdisjoint(
        op_types(engine))
    layer = convs[0]
    assert layer.origin == ("conv", "bn", "sig", "mul") and layer.attrs["activation"]["op"] == "Swish"


def test_silu_stays_pointwise_when_the_conv_output_is_read_elsewhere(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    tail = [helper.make_node("Sigmoid", ["c"], ["s1"], name="sig"), helper.make_node("Mul", ["c", "s1"], ["y"], name="mul"),
            helper.make_node("Relu", ["c"], ["z"], name="relu")]
    engine = build_and_check(conv_model(tail, outputs=(("y", [1, 4, 6, 6]), ("z", [1, 4, 6, 6]))), {"x": X})
    assert "PWN(sig, mul)" in names(engine) and "conv" in names(engine)
    assert "SwishFusion: Not fusing sig with mul: conv's output 'c' is also read elsewhere" in caplog.text


def test_sigmoid_times_another_tensor_is_not_swish(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    tail = [helper.make_node("Sigmoid", ["c"], ["s1"], name="sig"), helper.make_node("Mul", ["x", "s1"], ["y"], name="mul")]
    engine = build_and_check(conv_model(tail), {"x": X})
    assert "Swish" not in str([l.attrs.get("activation") for l in engine.plan.layers])
    assert "mul does not multiply the Sigmoid's own input" in caplog.text


def test_conv_output_is_graph_output_not_fused(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    model = conv_model([helper.make_node("Relu", ["c"], ["y"], name="relu")],
                       outputs=(("y", [1, 4, 6, 6]), ("c", [1, 4, 6, 6])))
    engine = build_and_check(model, {"x": X})
    assert [l.name for l in engine.plan.layers if parameter_type(l) == "Convolution"] == ["conv"]
    assert "network output" in caplog.text


def test_fuse_activation_direct_pass_call(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    g = import_onnx(conv_model([helper.make_node("LeakyRelu", ["c"], ["y"], name="lrelu", alpha=0.2)]))
    plog = PassLog("ConvReluFusion")
    fuse_activation(g, plog)
    assert plog.matches == 1 and plog.rejections == 0
    (node,) = g.nodes
    assert node.name == "conv + lrelu" and node.attrs["activation"]["op"] == "LeakyRelu"
    assert "ConvReluFusion: Fusing conv with lrelu" in caplog.text


# ---------------------------------------------------------------- matrix multiply
def test_matmul_bias_add_fuses():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "bias"], ["y"], name="bias_add")]
    model = make_model(nodes, [vi("x", [2, 3, 4])], [vi("y", [2, 3, 5])],
                       [init("W", rand((4, 5), 1)), init("bias", rand(5, 2))])
    engine = build_and_check(model, {"x": rand((2, 3, 4))})
    assert names(engine) == ["mm + bias_add"]
    assert parameter_type(engine.plan.layers[0]) == "MatrixMultiply"


def test_matmul_add_of_an_activation_is_a_residual_not_a_bias(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "z"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [3, 4]), vi("z", [3, 5])], [vi("y", [3, 5])], [init("W", rand((4, 5), 1))])
    engine = build_and_check(model, {"x": rand((3, 4)), "z": rand((3, 5), 4)})
    assert names(engine) == ["mm + add"]
    assert "MatMulAddFusion: Not fusing mm with add: the other operand is not a constant bias" in caplog.text
    assert "MatMulEltwiseSumFusion: Fusing mm with add" in caplog.text


def test_gemm_relu_fuses():
    nodes = [helper.make_node("Gemm", ["x", "W", "C"], ["g"], name="fc", transB=1),
             helper.make_node("Relu", ["g"], ["y"], name="relu")]
    model = make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 5])], [init("W", rand((5, 4), 1)), init("C", rand(5, 2))])
    engine = build_and_check(model, {"x": rand((2, 4))})
    assert names(engine) == ["fc + relu"]


BN8_INITS = [init("s", rand(8, 3)), init("bb", rand(8, 4)), init("m", rand(8, 5)), init("v", rand(8, 6, True))]


def test_linear_flatten_batchnorm_reshape_folds_to_one_product():
    """LeViT's MLPLayerWithBN (Linear -> flatten(0, 1) -> BatchNorm1d -> reshape back) and HardSwish after it: one
    layer, where the BN and both reshapes were three more."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="linear"),
             helper.make_node("Flatten", ["mm"], ["flat"], name="flatten", axis=2),
             helper.make_node("BatchNormalization", ["flat", "s", "bb", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Reshape", ["bn", "shape"], ["r"], name="reshape"),
             helper.make_node("HardSwish", ["r"], ["y"], name="act")]
    model = make_model(nodes, [vi("x", [1, 5, 6])], [vi("y", [1, 5, 8])],
                       [init("W", rand((6, 8), 1)), init("shape", np.array([1, 5, 8], np.int64))] + BN8_INITS)
    engine = build_and_check(model, {"x": rand((1, 5, 6), 2)})
    assert names(engine) == ["linear + bn + act"]


def test_gemm_batchnorm_folds_and_a_rank_3_batchnorm_stays(caplog):
    """Gemm -> BatchNorm1d (an ArcFace embedding head) folds; a BN over a rank-3 product normalizes its rows."""
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    nodes = [helper.make_node("Gemm", ["x", "W", "C"], ["g"], name="fc", transB=1, alpha=0.5, beta=2.0),
             helper.make_node("BatchNormalization", ["g", "s", "bb", "m", "v"], ["y"], name="features"),
             helper.make_node("MatMul", ["z", "W8"], ["mm"], name="mm"),
             helper.make_node("BatchNormalization", ["mm", "s", "bb", "m", "v"], ["y2"], name="rows_bn")]
    model = make_model(nodes, [vi("x", [3, 4]), vi("z", [1, 8, 4])], [vi("y", [3, 8]), vi("y2", [1, 8, 8])],
                       [init("W", rand((8, 4), 1)), init("C", rand(8, 2)), init("W8", rand((4, 8), 9))] + BN8_INITS)
    engine = build_and_check(model, {"x": rand((3, 4), 3), "z": rand((1, 8, 4), 4)})
    assert names(engine)[0] == "fc + features" and "rows_bn" in names(engine)
    assert "MatMulScaleFusion: Not fusing mm with rows_bn: rows_bn normalizes axis 1 of a rank-3 tensor" in caplog.text


# ---------------------------------------------------------------- pointwise and shuffles
def test_sigmoid_mul_becomes_pwn():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s1"], name="sig"), helper.make_node("Mul", ["x", "s1"], ["y"], name="mul")]
    model = make_model(nodes, [vi("x", [2, 3, 4])], [vi("y", [2, 3, 4])])
    engine = build_and_check(model, {"x": rand((2, 3, 4))})
    assert names(engine) == ["PWN(sig, mul)"]
    assert parameter_type(engine.plan.layers[0]) == "PointWise"
    assert engine.plan.layers[0].origin == ("sig", "mul")


def test_longer_pointwise_chain():
    nodes = [helper.make_node("Mul", ["x", "k"], ["a"], name="scale"), helper.make_node("Tanh", ["a"], ["b2"], name="tanh"),
             helper.make_node("Add", ["b2", "x"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])], [init("k", np.float32(0.5).reshape(1))])
    engine = build_and_check(model, {"x": rand((2, 3))})
    assert names(engine) == ["PWN(scale, tanh, add)"]


def test_reshape_transpose_reshape_is_one_shuffle():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r1"], name="r1"),
             helper.make_node("Transpose", ["r1"], ["t"], name="t", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["t", "s2"], ["y"], name="r2")]
    model = make_model(nodes, [vi("x", [2, 6, 4])], [vi("y", [2, 24])],
                       [init("s1", np.array([2, 2, 3, 4], dtype=np.int64)), init("s2", np.array([2, -1], dtype=np.int64))])
    engine = build_and_check(model, {"x": rand((2, 6, 4))})
    assert len(engine.plan.layers) == 1
    layer = engine.plan.layers[0]
    assert parameter_type(layer) == "Shuffle" and layer.origin == ("r1", "t", "r2")
    assert layer.name == "r1 + t + r2"
    info = engine.layer_info("detailed")["Layers"][0]
    assert info["ParameterType"] == "Shuffle" and info["ZeroIsPlaceholder"] == 1   # 0 in a target copies the axis
    assert (info["FirstTranspose"], info["Reshape"], info["SecondTranspose"]) == ([0, 1, 2], [2, 2, 3, 4], [0, 2, 1, 3])
    assert info["Steps"] == [{"reshape": [2, 2, 3, 4]}, {"transpose": [0, 2, 1, 3]}, {"reshape": [2, 24]}]


def test_noop_reshape_erased():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"], name="r"), helper.make_node("Relu", ["r"], ["y"], name="relu")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])], [init("s", np.array([2, 3], dtype=np.int64))])
    engine = build_and_check(model, {"x": rand((2, 3))})
    assert names(engine) == ["relu"]


# ---------------------------------------------------------------- cleanup passes
def test_identity_and_dropout_removed():
    nodes = [helper.make_node("Identity", ["x"], ["i"], name="id"), helper.make_node("Relu", ["i"], ["r"], name="relu"),
             helper.make_node("Dropout", ["r"], ["d"], name="drop"), helper.make_node("Tanh", ["d"], ["y"], name="tanh")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    engine = build_and_check(model, {"x": rand((2, 3))}, disabled_passes={"PointWiseFusion"})
    assert not {"Identity", "Dropout"} & set(op_types(engine))
    assert names(engine) == ["relu", "tanh"]


def test_identity_into_graph_output_keeps_output_name():
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Identity", ["r"], ["y"], name="id")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    engine = build_and_check(model, {"x": rand((2, 3))})
    assert names(engine) == ["relu"] and engine.output_names == ["y"]


def test_constant_folding_removes_shape_chain():
    nodes = [helper.make_node("Shape", ["x"], ["sh"], name="shape"),
             helper.make_node("Gather", ["sh", "i"], ["n"], name="gather", axis=0),
             helper.make_node("Concat", ["n", "m1"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    model = make_model(nodes, [vi("x", [2, 3, 4])], [vi("y", [2, 12])],
                       [init("i", np.array([0], dtype=np.int64)), init("m1", np.array([-1], dtype=np.int64))])
    engine = build_and_check(model, {"x": rand((2, 3, 4))})
    assert not {"Shape", "Gather", "Concat"} & set(op_types(engine))
    assert names(engine) == ["reshape", "relu"]


def test_dead_layers_removed():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"), helper.make_node("Exp", ["x"], ["unused"], name="dead")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    engine = build_and_check(model, {"x": rand((2, 3))})
    assert names(engine) == ["relu"]


# ---------------------------------------------------------------- verbose log milestones
def test_build_log_milestones(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    tail = [helper.make_node("Identity", ["c"], ["i"], name="id"), helper.make_node("Relu", ["i"], ["y"], name="relu")]
    kiln.build(conv_model(tail), autotune=False)
    text = caplog.text
    assert "Original: 3 layers" in text
    assert "After dead-layer removal: 3 layers" in text
    assert "After identity removal: 2 layers" in text
    assert "After vertical fusions: 1 layers" in text
    assert "Graph construction and optimization completed in" in text
    assert "Removing id" in text and "ConvReluFusion: Fusing conv with relu" in text


def test_disabled_pass_is_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    engine = kiln.build(conv_model([helper.make_node("Relu", ["c"], ["y"], name="relu")]),
                        disabled_passes={"ConvReluFusion"}, autotune=False)
    assert "Skipping ConvReluFusion (disabled)" in caplog.text
    assert names(engine).count("relu") == 1


@pytest.mark.parametrize("opset", [13, 17])
def test_full_block_matches_ort(opset):
    """Conv+BN+Relu, conv+BN, residual Add+Relu, then pooling and a MatMul head: every fusion at once."""
    nodes = [conv("c1", name="conv1"), helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"], name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"), conv("c2", "r1", name="conv2"),
             helper.make_node("Add", ["c2", "x"], ["a"], name="add"), helper.make_node("Relu", ["a"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "Wfc"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "bfc"], ["y"], name="fc_bias")]
    model = make_model(nodes, [vi("x", [1, 4, 6, 6])], [vi("y", [1, 3])],
                       CONV_INITS + BN_INITS + [init("Wfc", rand((4, 3), 8)), init("bfc", rand(3, 9))], opset=opset)
    engine = build_and_check(model, {"x": X})
    layer_names = names(engine)
    assert "conv1 + bn1 + relu1" in layer_names and "conv2 + add + relu2" in layer_names
    assert "fc + fc_bias" in layer_names
