"""Per-op numerics: tiny single-op (or op + Conv) ONNX models, kiln vs onnxruntime within 1e-4 relative."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort
from kiln.trt.vocab import parameter_type

F32 = TensorProto.FLOAT


def check(nodes, inputs, inits=(), opset=17, outputs=("y",), shapes=None, build_opts=None):
    """Build a model from `nodes`, feed `inputs` (name -> array), compare every output to onnxruntime."""
    in_vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
             for n, a in inputs.items()]
    model = make_model(nodes, in_vi, [helper.make_empty_tensor_value_info(n) for n in outputs], list(inits), opset=opset)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    model.graph.ClearField("output")
    model.graph.output.extend([known[n] for n in outputs])
    expected = run_ort(model, inputs)
    engine = kiln.build(model, **{"autotune": False, **(build_opts or {})})   # kernel choice: tests/tactics
    got = engine.run(inputs)
    for name, exp in zip(outputs, expected):
        assert got[name].dtype == exp.dtype, (name, got[name].dtype, exp.dtype)
        assert_close_to_ort(got[name], exp)
    return engine


# ---------------------------------------------------------------- convolution
CONV_CASES = {
    "plain": dict(x=(1, 3, 8, 8), w=(4, 3, 3, 3), attrs=dict(pads=[1, 1, 1, 1])),
    "groups": dict(x=(1, 4, 8, 8), w=(6, 2, 3, 3), attrs=dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": dict(x=(1, 4, 8, 8), w=(4, 1, 3, 3), attrs=dict(group=4, pads=[1, 1, 1, 1])),
    "dilation": dict(x=(1, 3, 9, 9), w=(4, 3, 3, 3), attrs=dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "strides": dict(x=(1, 3, 9, 9), w=(4, 3, 3, 3), attrs=dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "asymmetric_pads": dict(x=(1, 3, 8, 8), w=(4, 3, 3, 3), attrs=dict(pads=[0, 1, 2, 0])),
    "same_upper": dict(x=(1, 3, 8, 8), w=(4, 3, 4, 4), attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "same_lower": dict(x=(1, 3, 7, 7), w=(4, 3, 2, 2), attrs=dict(auto_pad="SAME_LOWER")),
    "valid": dict(x=(1, 3, 8, 8), w=(4, 3, 3, 3), attrs=dict(auto_pad="VALID")),
    "no_bias": dict(x=(1, 3, 8, 8), w=(4, 3, 3, 3), attrs=dict(pads=[1, 1, 1, 1]), bias=False),
    "conv1d": dict(x=(2, 3, 10), w=(4, 3, 3), attrs=dict(pads=[1, 0], strides=[2])),
    "1x1_rect": dict(x=(1, 3, 5, 7), w=(4, 3, 1, 1), attrs={}),
}


@pytest.mark.parametrize("case", CONV_CASES, ids=list(CONV_CASES))
def test_conv(case):
    c = CONV_CASES[case]
    inits = [init("w", rand(c["w"], 1))]
    ins = ["x", "w"]
    if c.get("bias", True):
        inits.append(init("b", rand(c["w"][0], 2)))
        ins.append("b")
    check([helper.make_node("Conv", ins, ["y"], name="conv", **c["attrs"])], {"x": rand(c["x"])}, inits)


def test_batchnorm_standalone():
    inits = [init("s", rand(4, 1)), init("b", rand(4, 2)), init("m", rand(4, 3)), init("v", rand(4, 4, True))]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3)
    check([node], {"x": rand((2, 4, 5, 5))}, inits)


# ---------------------------------------------------------------- activations / unary
UNARY = {
    "Relu": {}, "LeakyRelu": dict(alpha=0.2), "Sigmoid": {}, "HardSigmoid": dict(alpha=0.3, beta=0.4),
    "HardSwish": {}, "Tanh": {},
}


@pytest.mark.parametrize("op", UNARY)
def test_unary_activation(op):
    x = rand((2, 3, 4, 5)) * 4
    check([helper.make_node(op, ["x"], ["y"], **UNARY[op])], {"x": x})


def test_sqrt():
    check([helper.make_node("Sqrt", ["x"], ["y"])], {"x": rand((3, 7), positive=True)})


@pytest.mark.parametrize("bounds", ["min_max", "max_only", "min_only", "none"])
def test_clip_with_inputs(bounds):
    ins = {"min_max": ["x", "lo", "hi"], "max_only": ["x", "", "hi"], "min_only": ["x", "lo"], "none": ["x"]}[bounds]
    inits = [init("lo", np.float32(-0.5)), init("hi", np.float32(0.7))]
    inits = [i for i in inits if i.name in ins]
    check([helper.make_node("Clip", ins, ["y"])], {"x": rand((2, 3, 4))}, inits)


# ---------------------------------------------------------------- binary with broadcasting
BINARY_SHAPES = [((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (5,)), ((2, 3, 4, 5), (3, 1, 1)),
                 ((1, 3, 1, 5), (2, 1, 4, 1)), ((4, 5), ())]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_binary_broadcast(op, shapes):
    a = rand(shapes[0], 1, positive=(op == "Pow"))
    b = rand(shapes[1], 2) if op != "Div" else rand(shapes[1], 2, positive=True)
    check([helper.make_node(op, ["a", "b"], ["y"])], {"a": a, "b": np.asarray(b, dtype=np.float32)})


@pytest.mark.parametrize("base, exponent", [(((2, 3, 4), np.float32), np.float32(2)), (((2, 3), np.float32), [0.5]),
                                             (((), np.float32), [3.0]), (((2, 3), np.int32), np.float32(3)),
                                             (((2, 3), np.int32), np.float32(-1))],
                         ids=["square", "sqrt-1elem", "0d-base-1d-exp", "int-base", "int-base-negative"])
def test_pow_one_element_exponent(base, exponent):
    """A one-element constant exponent runs torch's scalar path; shapes and the base's type follow ONNX."""
    shape, dtype = base
    x = (np.abs(rand(shape or (1,), 3)) * 4).reshape(shape).astype(dtype)
    check([helper.make_node("Pow", ["x", "e"], ["y"])], {"x": x}, [init("e", np.asarray(exponent, np.float32))])


def test_scalar_graph_input_and_output():
    check([helper.make_node("Mul", ["a", "b"], ["y"])], {"a": np.array(1.5, np.float32), "b": np.array(-2, np.float32)})


def test_binary_with_constant_operand():
    check([helper.make_node("Mul", ["x", "c"], ["y"])], {"x": rand((2, 3, 4))}, [init("c", rand((3, 1), 5))])


# ---------------------------------------------------------------- pooling
MAXPOOL = {
    "basic": dict(kernel_shape=[2, 2], strides=[2, 2]),
    "pads": dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    "asym_pads": dict(kernel_shape=[3, 3], pads=[0, 1, 2, 1], strides=[2, 2]),
    "ceil_mode": dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
    "ceil_pads": dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    "same_upper": dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
}


@pytest.mark.parametrize("case", MAXPOOL)
def test_maxpool(case):
    check([helper.make_node("MaxPool", ["x"], ["y"], **MAXPOOL[case])], {"x": rand((1, 3, 8, 8))})


AVGPOOL = {
    "basic": dict(kernel_shape=[2, 2], strides=[2, 2]),
    "pads_exclude": dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
    "pads_include": dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
    "asym_exclude": dict(kernel_shape=[3, 3], pads=[0, 1, 2, 1], strides=[2, 2], count_include_pad=0),
    "asym_include": dict(kernel_shape=[3, 3], pads=[0, 1, 2, 1], strides=[2, 2], count_include_pad=1),
    "ceil_mode": dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
}


@pytest.mark.parametrize("case", AVGPOOL)
def test_averagepool(case):
    check([helper.make_node("AveragePool", ["x"], ["y"], **AVGPOOL[case])], {"x": rand((1, 3, 8, 8))})


def test_global_average_pool():
    check([helper.make_node("GlobalAveragePool", ["x"], ["y"])], {"x": rand((2, 3, 5, 6))})


# ---------------------------------------------------------------- data movement
@pytest.mark.parametrize("axis", [1, 2, 0, -1])
def test_flatten(axis):
    check([helper.make_node("Flatten", ["x"], ["y"], axis=axis)], {"x": rand((2, 3, 4, 5))})


@pytest.mark.parametrize("shape", [[0, -1], [2, 0, 20], [-1, 5], [0, 3, 2, 10]])
def test_reshape(shape):
    check([helper.make_node("Reshape", ["x", "s"], ["y"])], {"x": rand((2, 3, 4, 5))},
          [init("s", np.array(shape, dtype=np.int64))])


@pytest.mark.parametrize("perm", [[0, 2, 3, 1], [3, 2, 1, 0], None])
def test_transpose(perm):
    attrs = {} if perm is None else {"perm": perm}
    check([helper.make_node("Transpose", ["x"], ["y"], **attrs)], {"x": rand((2, 3, 4, 5))})


@pytest.mark.parametrize("opset", [11, 13, 17])
@pytest.mark.parametrize("axes", [[1], [1, -1], None])
def test_squeeze(opset, axes):
    x = rand((2, 1, 4, 1))
    inits, ins, attrs = [], ["x"], {}
    if axes is not None and opset >= 13:
        inits, ins = [init("axes", np.array(axes, dtype=np.int64))], ["x", "axes"]
    elif axes is not None:
        attrs = {"axes": axes}
    check([helper.make_node("Squeeze", ins, ["y"], **attrs)], {"x": x}, inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 13, 17])
@pytest.mark.parametrize("axes", [[0], [1, -1], [0, 3]])
def test_unsqueeze(opset, axes):
    x = rand((2, 3))
    if opset >= 13:
        node, inits = helper.make_node("Unsqueeze", ["x", "axes"], ["y"]), [init("axes", np.array(axes, dtype=np.int64))]
    else:
        node, inits = helper.make_node("Unsqueeze", ["x"], ["y"], axes=axes), []
    check([node], {"x": x}, inits, opset=opset)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = {0: [(1, 3, 4), (2, 3, 4)], 1: [(2, 1, 4), (2, 3, 4)], -1: [(2, 3, 2), (2, 3, 4)]}[axis]
    check([helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=axis)],
          {"a": rand(shapes[0], 1), "b": rand(shapes[1], 2)}, [init("c", rand(shapes[1], 3))])


# ---------------------------------------------------------------- matrix multiply, softmax
GEMM = {
    "plain": dict(a=(3, 4), b=(4, 5), c=None, attrs={}),
    "transA": dict(a=(4, 3), b=(4, 5), c=(5,), attrs=dict(transA=1)),
    "transB": dict(a=(3, 4), b=(5, 4), c=(3, 5), attrs=dict(transB=1)),
    "alpha_beta": dict(a=(3, 4), b=(5, 4), c=(1, 5), attrs=dict(transB=1, alpha=0.5, beta=2.0)),
    "both_trans": dict(a=(4, 3), b=(5, 4), c=(3, 1), attrs=dict(transA=1, transB=1, alpha=1.5, beta=0.25)),
}


@pytest.mark.parametrize("case", GEMM)
def test_gemm(case):
    g = GEMM[case]
    inits, ins = [init("b", rand(g["b"], 2))], ["a", "b"]
    if g["c"] is not None:
        inits.append(init("c", rand(g["c"], 3)))
        ins.append("c")
    check([helper.make_node("Gemm", ins, ["y"], **g["attrs"])], {"a": rand(g["a"], 1)}, inits)


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                    ((2, 1, 3, 4), (3, 4, 2))], ids=str)
def test_matmul(shapes):
    check([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": rand(shapes[0], 1), "b": rand(shapes[1], 2)})


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax(axis, opset):
    x = rand((2, 3, 4)) * 3
    check([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], {"x": x}, opset=opset)


# ---------------------------------------------------------------- passthrough and constants
def test_identity_dropout_constant():
    const = helper.make_node("Constant", [], ["k"], value=helper.make_tensor("kv", F32, [4], [1, 2, 3, 4]))
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Dropout", ["i"], ["d"]),
             const, helper.make_node("Add", ["d", "k"], ["y"])]
    check(nodes, {"x": rand((2, 4))})


def test_dropout_with_mask_output():
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"])]
    check(nodes, {"x": rand((2, 4))}, outputs=("y", "mask"))


def test_identity_is_whole_graph():
    check([helper.make_node("Identity", ["x"], ["y"])], {"x": rand((2, 4))})


# ---------------------------------------------------------------- shape arithmetic
@pytest.mark.parametrize("index", [np.array(0, dtype=np.int64), np.array([1], dtype=np.int64)],
                         ids=["scalar_index", "vector_index"])
def test_shape_gather_unsqueeze_concat_reshape(index):
    squeeze = [helper.make_node("Squeeze", ["g", "ax"], ["n"])] if index.ndim else []
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n" if not index.ndim else "g"], axis=0),
        *squeeze,
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [init("i0", index), init("ax", np.array([0], dtype=np.int64)),
             init("minus1", np.array([-1], dtype=np.int64))]
    check(nodes, {"x": rand((2, 3, 4, 5))}, inits)


def test_shape_slice_cast_chain():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "st", "en"], ["hw"]),
        helper.make_node("Cast", ["hw"], ["hwf"], to=F32),
        helper.make_node("Mul", ["x", "scale"], ["xs"]),
        helper.make_node("ReduceSum", ["hwf"], ["tot"], keepdims=0),
        helper.make_node("Add", ["xs", "tot"], ["y"]),
    ]
    inits = [init("st", np.array([2], dtype=np.int64)), init("en", np.array([4], dtype=np.int64)),
             init("scale", np.float32(0.5))]
    check(nodes, {"x": rand((2, 3, 4, 5))}, inits)


def test_shape_output_int64():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["s", "st", "en"], ["y"])]
    inits = [init("st", np.array([1], dtype=np.int64)), init("en", np.array([-1], dtype=np.int64))]
    check(nodes, {"x": rand((2, 3, 4, 5))}, inits)


# ---------------------------------------------------------------- op after Conv (fused and unfused kernels)
CONV_THEN = {
    "leaky_relu": [helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1)],
    "relu6": [helper.make_node("Clip", ["c", "zero", "six"], ["y"])],
    "clip_max_only": [helper.make_node("Clip", ["c", "", "six"], ["y"])],
    "sigmoid": [helper.make_node("Sigmoid", ["c"], ["y"])],
    "tanh": [helper.make_node("Tanh", ["c"], ["y"])],
    "hard_swish": [helper.make_node("HardSwish", ["c"], ["y"])],
    "hard_sigmoid": [helper.make_node("HardSigmoid", ["c"], ["y"], alpha=0.25, beta=0.4)],
    "residual_relu": [helper.make_node("Add", ["c", "x"], ["sum"]), helper.make_node("Relu", ["sum"], ["y"])],
    "residual_first_relu": [helper.make_node("Add", ["x", "c"], ["sum"]), helper.make_node("Relu", ["sum"], ["y"])],
    "residual_sigmoid": [helper.make_node("Add", ["c", "x"], ["sum"]), helper.make_node("Sigmoid", ["sum"], ["y"])],
    "bn_relu": [helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
                helper.make_node("Relu", ["n"], ["y"])],
    "swish": [helper.make_node("Sigmoid", ["c"], ["g"]), helper.make_node("Mul", ["c", "g"], ["y"])],
}


@pytest.mark.parametrize("case", CONV_THEN)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_conv_followed_by(case, fused):
    inits = [init("w", rand((4, 4, 3, 3), 1)), init("bias", rand(4, 2)), init("zero", np.float32(0)),
             init("six", np.float32(6)), init("s", rand(4, 3)), init("b", rand(4, 4)), init("m", rand(4, 5)),
             init("v", rand(4, 6, True))]
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], ["c"], name="conv", pads=[1, 1, 1, 1])] + CONV_THEN[case]
    inits = [i for i in inits if any(i.name in n.input for n in nodes)]
    disabled = set() if fused else {"ConvScaleFusion", "ConvEltwiseSumFusion", "ConvReluFusion", "PointWiseFusion"}
    engine = check(nodes, {"x": rand((1, 4, 6, 6)) * 3}, inits, build_opts={"disabled_passes": disabled})
    conv_layers = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    assert len(conv_layers) == 1
    if fused and case not in ("swish",):
        assert len(conv_layers[0].origin) > 1, [l.name for l in engine.plan.layers]
    if not fused:
        assert conv_layers[0].origin == ("conv",)
