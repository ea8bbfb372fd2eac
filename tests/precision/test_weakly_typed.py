"""float16 models (onnxruntime's `convert_float_to_float16`, as GPU exports and Optimum's O4 write them) build weakly
typed, as TensorRT builds them: FP32 layers inside, the model's float16 inputs/outputs kept, reduced precision only
where --fp16/--bf16 allow it; `strongly_typed=True` (trtexec --stronglyTyped) computes in the model's types.
References: onnxruntime running the FP32 model whose weights the float16 one stores exactly."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import ModelError
from kiln.preprocess.widen import Widening, widen_reduced_floats
from kiln.tactics.onednn_conv import bf16_available
from tests.cli.test_cli import kiln_cli
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort
from tests.precision.models import conv_net, transformer_net

float16 = pytest.importorskip("onnxruntime.transformers.float16")
# model, input, shape; the output Cast is a layer of its own after a Gemm and after the residual sum's product
MODELS = {"conv": (conv_net, "x", (1, 3, 16, 16)), "transformer": (transformer_net, "x", (1, 8, 16))}
# the FP32 models' own layers (untimed builds)
FP32_LAYERS = {"conv": ["Reformatting CopyNode for Input Tensor 0 to conv1 + relu1", "conv1 + relu1", "conv2 + relu2",
                        "gap", "flatten", "fc", "head"],
               "transformer": ["q_proj || k_proj || v_proj", "k_t + scores + scale_mul + softmax + attn", "o_proj + residual1",
                               "ln", "ffn1 + gelu_div + gelu_erf + gelu_add + gelu_mul + gelu_half",
                               "ffn2 + residual2"]}


def fp16_exact(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every float32 weight rounded to float16's grid, so its float16 twin stores the same weights."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            a = numpy_helper.to_array(t)
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(a.astype(np.float16).astype(np.float32), t.name))
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    make, name, shape = MODELS[request.param]
    fp32 = fp16_exact(make())
    x = rand(shape, 21).astype(np.float16)
    return fp32, float16.convert_float_to_float16(fp32, keep_io_types=False), name, x, FP32_LAYERS[request.param]


def test_float16_model_runs_fp32_layers_and_keeps_its_float16_io(pair, caplog):
    fp32, fp16, name, x, fp32_layers = pair
    with caplog.at_level(logging.INFO, logger="kiln"):   # untimed: the layer lists must not depend on timing
        engine = kiln.build(fp16, regions=False, autotune=False)
    assert "built weakly typed" in caplog.text and "float16" in caplog.text
    assert [l.name for l in kiln.build(fp32, regions=False, autotune=False).plan.layers] == fp32_layers
    layers = engine.plan.layers
    # the FP32 model's layers, a Cast reading the float16 input and one writing the float16 output; every layer
    # computes in FP32
    assert len(layers) == len(fp32_layers) + 2
    assert [(layers[0].name, layers[0].op_type), layers[-1].name] == [(f"{name} to FP32", "Cast"), "y to float16"]
    assert {l.name for l in layers[1:-1]} == set(fp32_layers)
    assert {l.precision for l in layers} == {"FP32"}
    got = engine.run({name: x})["y"]
    assert got.dtype == np.float16
    # computed in FP32: within the output's own float16 rounding of onnxruntime's FP32 run
    want = run_ort(fp32, {name: x.astype(np.float32)})[0]
    assert_close_to_ort(got.astype(np.float32), want, rel=1e-3)


def test_float16_weights_with_float32_io_leave_no_cast_layers(pair):
    fp32, _, name, x, fp32_layers = pair
    fp16 = float16.convert_float_to_float16(fp32, keep_io_types=True)
    assert sum(n.op_type == "Cast" for n in fp16.graph.node) >= 2
    engine = kiln.build(fp16, regions=False, autotune=False)
    assert len(engine.plan.layers) == len(fp32_layers)
    assert not any(l.op_type == "Cast" for l in engine.plan.layers)
    assert all(l.precision == "FP32" for l in engine.plan.layers)
    got = engine.run({name: x.astype(np.float32)})["y"]
    assert got.dtype == np.float32
    assert_close_to_ort(got, run_ort(fp32, {name: x.astype(np.float32)})[0], rel=1e-4)


def test_strongly_typed_build_computes_in_the_models_float16(pair):
    fp32, fp16, name, x = pair[:4]
    engine = kiln.build(fp16, strongly_typed=True)
    heavy = [l for l in engine.plan.layers if l.op_type in ("Conv", "MatMul", "Gemm")]
    assert heavy and all(l.precision == "FP16" for l in heavy)
    got = engine.run({name: x})["y"]
    assert got.dtype == np.float16
    assert cosine(got, run_ort(fp16, {name: x})[0]) > 0.9999


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 arithmetic: --bf16 is denied per "
                    "layer (tests/precision/test_bf16.py)")
def test_bf16_is_granted_on_a_float16_model_within_the_budget(pair):
    fp32, fp16, name, x = pair[:4]
    # "prefer": with the default constraints the autotuner may keep a layer FP32 when its FP32 kernel times faster
    engine = kiln.build(fp16, bf16=True, tactic_sources="-openvino,-onnxruntime", precision_constraints="prefer")
    heavy = [l for l in engine.plan.layers if l.op_type in ("Conv", "MatMul", "Gemm")]
    assert any(l.precision == "BF16" for l in heavy)
    got = engine.run({name: x})["y"]
    assert cosine(got, run_ort(fp32, {name: x.astype(np.float32)})[0]) > 0.999


def test_strongly_typed_refuses_precision_flags(pair, tmp_path):
    fp16 = pair[1]
    with pytest.raises(ModelError, match=r"strongly typed .* drop --bf16 or --strongly-typed"):
        kiln.build(fp16, strongly_typed=True, bf16=True)
    path, engine = tmp_path / "m.onnx", tmp_path / "m.kiln"
    onnx.save(fp16, path)
    r = kiln_cli("build", str(path), "-o", str(engine), "--strongly-typed", "--fp16")
    assert r.returncode == 2 and "drop --fp16 or --strongly-typed" in r.stderr and not engine.exists()
    r = kiln_cli("trtexec", f"--onnx={path}", "--stronglyTyped", f"--saveEngine={engine}")
    assert r.returncode == 0, r.stderr
    assert engine.exists()


def _widening_model() -> onnx.ModelProto:
    """float16 everywhere a type can hide: a bfloat16 weight, Constant, ConstantOfShape, Cast(to=FLOAT16), and an
    If branch with its own float16 initializer and output."""
    h = helper.make_node
    branch = lambda value, name: helper.make_graph(  # noqa: E731
        [h("Add", ["c", f"{name}_k"], [f"{name}_out"], name=f"{name}_add")], name, [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT16, [4])],
        [numpy_helper.from_array(np.full(4, value, np.float16), f"{name}_k")])
    nodes = [h("Cast", ["x"], ["xh"], name="to_half", to=TensorProto.FLOAT16),
             h("Constant", [], ["k"], name="k", value=numpy_helper.from_array(np.full(4, 0.5, np.float16))),
             h("Mul", ["xh", "k"], ["a"], name="mul"),
             h("Cast", ["wb"], ["wh"], name="bf_to_half", to=TensorProto.FLOAT16),
             h("Add", ["a", "wh"], ["b"], name="add"),
             h("ConstantOfShape", ["shape"], ["z"], name="zeros",
               value=numpy_helper.from_array(np.array([0.25], np.float16))),
             h("Add", ["b", "z"], ["c"], name="add_z"),
             h("If", ["flag"], ["y"], name="branch", then_branch=branch(1.0, "then"), else_branch=branch(-1.0, "else"))]
    bf16 = helper.make_tensor("wb", TensorProto.BFLOAT16, [4], [1.5, -2.0, 0.75, 3.0])
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4])],
                      [bf16, init("shape", np.array([4], np.int64)), init("flag", np.array(True))])


def test_widening_leaves_no_reduced_float_type_but_the_models_output():
    model = _widening_model()
    wide, widening = widen_reduced_floats(model)
    assert widening.types == ("bfloat16", "float16")
    assert (widening.weights, widening.casts, widening.inputs, widening.outputs) == (5, 2, 0, 1)
    reduced = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    graphs = [wide.graph] + [a.g for n in wide.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    assert not any(t.data_type in reduced for g in graphs for t in g.initializer)
    assert [n.name for n in wide.graph.node if n.op_type == "Cast" and n.attribute[0].i in reduced] == ["y to float16"]
    x = np.array([1.0, 2.0, -3.0, 4.0], np.float32)
    want = (x * 0.5 + np.array([1.5, -2.0, 0.75, 3.0]) + 0.25 + 1.0).astype(np.float16)
    np.testing.assert_array_equal(run_ort(wide, {"x": x})[0], want)
    assert not widen_reduced_floats(wide)[1].changed   # widening twice adds nothing
    fp32_only = conv_net()
    same, nothing = widen_reduced_floats(fp32_only)
    assert same is fp32_only and nothing == Widening()


def test_a_float16_input_read_only_inside_a_branch_is_cast_too():
    """The branch's float16 constant is widened, so the input it adds to must be read through a Cast as well, though
    no top-level node reads it."""
    h = helper.make_node
    branch = helper.make_graph([h("Add", ["x", "c"], ["b"], name="add")], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT16, [3])],
                               [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float16), "c")])
    model = make_model([h("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=branch)],
                       [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                        helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [3])])
    wide, widening = widen_reduced_floats(model)
    assert widening.inputs == 1
    onnx.checker.check_model(wide, full_check=True)
    x = np.array([0.5, -1.0, 2.0], np.float16)
    np.testing.assert_array_equal(run_ort(wide, {"cond": np.array(True), "x": x})[0], x + np.array([1, 2, 3], np.float16))
