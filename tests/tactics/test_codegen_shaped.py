"""Generated pointwise kernels for layers whose shapes vary per call (kiln.tactics.codegen.ShapedPointWise): the
broadcast pattern compiled once, each call's loop nest passed in; a call of another pattern runs torch's kernel.
Checked against torch formulas (exact where the program rounds once) and onnxruntime for whole models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.ops import lookup
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.codegen import CodegenPointWiseBf16Tactic, CodegenPointWiseTactic, ShapedPointWise
from tests.conftest import assert_close_to_ort, init, make_model, run_ort, unfused_onnxruntime
from tests.tactics.amx import built_with, quantize_path  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler that builds OpenMP shared libraries")

ADD_RELU = [{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Relu", "attrs": {}, "args": ["t0"]}]


def dynamic_view(program, shapes, dynamic, consts=None, dtypes=None, out="float32", op="PointWise", attrs=None):
    dtypes = tuple(dtypes or ("float32",) * len(shapes))
    return LayerView(op, "kiln", attrs or {"program": program}, tuple(shapes), dtypes, consts or {}, (out,), 17,
                     tuple(dynamic))


def compiled_calls(kernel: ShapedPointWise) -> dict:
    """Per shapes met: whether the generated kernel ran it (False: torch's kernel did)."""
    return {shapes: plan is not None for (shapes, _), plan in kernel.plans.items()}


def assert_all_compiled(kernel: ShapedPointWise, shapes_met: int) -> None:
    """The generated kernel ran every one of the `shapes_met` input shapes (none fell back to torch's)."""
    calls = compiled_calls(kernel)
    assert len(calls) == shapes_met and all(calls.values()), calls


def test_an_attention_mask_add_follows_each_calls_batch_and_length():
    """Scores [b, h, s, s] + mask [b, 1, 1, s] with b and s dynamic: one kernel for every (b, s); at s = 1 the mask
    broadcasts along the inner loop, a pattern the kernel was not compiled for, and torch's kernel runs it."""
    view = dynamic_view(ADD_RELU, [(2, 4, 16, 16), (2, 1, 1, 16)], [(0, 2, 3), (0, 3)])
    assert CodegenPointWiseTactic().supports(view)
    kernel = CodegenPointWiseTactic().prepare(view)
    assert isinstance(kernel, ShapedPointWise)
    # (1, 3, 9000): rows longer than one block of work (BLOCK_ELEMENTS), each split among the threads
    for b, q, s in ((2, 16, 16), (1, 7, 7), (3, 33, 33), (1, 1, 1), (2, 0, 0), (1, 3, 9000)):
        scores, mask = torch.randn(b, 4, q, s), torch.randn(b, 1, 1, s)
        y = kernel([scores, mask])[0]
        assert torch.equal(y, torch.relu(scores + mask)), (b, q, s)
    assert compiled_calls(kernel) == {((2, 4, 16, 16), (2, 1, 1, 16)): True, ((1, 4, 7, 7), (1, 1, 1, 7)): True,
                                      ((3, 4, 33, 33), (3, 1, 1, 33)): True, ((1, 4, 1, 1), (1, 1, 1, 1)): False,
                                      ((2, 4, 0, 0), (2, 1, 1, 0)): True, ((1, 4, 3, 9000), (1, 1, 1, 9000)): True}


def test_a_bias_and_gelu_over_dynamic_rows_reads_its_constant_through_the_nest():
    bias = torch.randn(48)
    program = [{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Gelu", "attrs": {}, "args": ["t0"]}]
    kernel = CodegenPointWiseTactic().prepare(dynamic_view(program, [(1, 8, 48), (48,)], [(0, 1), ()], {1: bias}))
    for b, s in ((1, 8), (3, 5), (2, 1)):
        x = torch.randn(b, s, 48)
        y = kernel([x, None])[0]
        torch.testing.assert_close(y, torch.nn.functional.gelu(x + bias), rtol=1e-5, atol=1e-6)
    assert_all_compiled(kernel, 3)


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_per_channel_program_keeps_the_callers_layout_for_any_batch(channels_last):
    scale = torch.rand(8, 1, 1) + 0.5
    program = [{"op": "Mul", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Sigmoid", "attrs": {}, "args": ["t0"]}]
    kernel = CodegenPointWiseTactic().prepare(dynamic_view(program, [(1, 8, 5, 6), (8, 1, 1)], [(0,), ()],
                                                           {1: scale}))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for n in (1, 3):
        x = torch.randn(n, 8, 5, 6)
        y = kernel([x.contiguous(memory_format=fmt), None])[0]
        torch.testing.assert_close(y, torch.sigmoid(x * scale), rtol=1e-6, atol=1e-6)
        assert y.is_contiguous(memory_format=fmt)
    assert_all_compiled(kernel, 2)


def test_a_channel_major_call_whose_other_input_reads_otherwise_runs_torchs_kernel():
    """Compiled for x [n, 4, h, w] + a runtime per-channel [4, 1, 1] (read alike in NCHW and NHWC order); a call
    whose other input is a whole [4, h, w] cannot read it in NHWC order beside a channels-last x, so torch's kernel
    runs it (and is right)."""
    view = dynamic_view(ADD_RELU, [(1, 4, 6, 6), (4, 1, 1)], [(0, 2, 3), (1, 2)])
    kernel = CodegenPointWiseTactic().prepare(view)
    x, channel, plane = torch.randn(2, 4, 3, 5), torch.randn(4, 1, 1), torch.randn(4, 3, 5)
    for other in (channel, plane):
        y = kernel([x.contiguous(memory_format=torch.channels_last), other])[0]
        assert torch.equal(y, torch.relu(x + other)) and y.is_contiguous(memory_format=torch.channels_last)
    assert compiled_calls(kernel) == {((2, 4, 3, 5), (4, 1, 1)): True, ((2, 4, 3, 5), (4, 3, 5)): False}


def test_an_int8_sum_with_dynamic_dims_rounds_as_the_reference_op(quantize_path):
    quant = {"a_scale": 0.03, "a_zero_point": 120, "b_scale": 0.07, "b_zero_point": -5, "y_scale": 0.06,
             "y_zero_point": 10, "y_dtype": "uint8"}
    view = dynamic_view(None, [(1, 16, 40), (1, 16, 40)], [(0, 1), (0, 1)], dtypes=("uint8", "int8"), out="uint8",
                        op="QAdd", attrs={"quant": quant})
    assert CodegenPointWiseTactic().supports(view)
    kernel = CodegenPointWiseTactic().prepare(view)
    reference = lookup("QAdd", "kiln").impl
    rng = np.random.default_rng(1)
    for b, s in ((1, 16), (2, 3), (4, 77)):
        a = torch.from_numpy(rng.integers(0, 256, (b, s, 40)).astype(np.uint8))
        c = torch.from_numpy(rng.integers(-128, 128, (b, s, 40)).astype(np.int8))
        y = kernel([a, c])[0]
        assert y.dtype == torch.uint8
        assert torch.equal(y, reference({"quant": quant}, [a, c])[0])
    assert_all_compiled(kernel, 3)


def test_bf16_storage_with_dynamic_dims_rounds_only_the_output():
    kernel = CodegenPointWiseBf16Tactic().prepare(
        dynamic_view(ADD_RELU, [(1, 8, 32), (1, 8, 32)], [(0, 1), (0, 1)], dtypes=("bfloat16", "float32"),
                     out="bfloat16"))
    for b, s in ((1, 8), (2, 13)):
        x, r = torch.randn(b, s, 32).bfloat16(), torch.randn(b, s, 32)
        y = kernel([x, r])[0]
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, torch.relu(x.float() + r).bfloat16())
    x, r = torch.randn(2, 1, 32).bfloat16(), torch.randn(2, 5, 32)   # x broadcast along rows: still the kernel's
    assert torch.equal(kernel([x, r])[0], torch.relu(x.float() + r).bfloat16())
    assert_all_compiled(kernel, 3)


def test_a_dynamic_model_runs_its_pointwise_layers_on_generated_kernels():
    """x [n, c, h, w] * per-channel constant -> Sigmoid -> + x, exported with batch and size dynamic: built for a
    profile, the fused program is a generated kernel (before, any dynamic axis sent it to torch), and every shape
    in the profile matches onnxruntime."""
    h = helper.make_node
    nodes = [h("Mul", ["x", "scale"], ["m"]), h("Sigmoid", ["m"], ["g"]), h("Add", ["g", "x"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, "h", "w"])],
                       [init("scale", np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(8, 1, 1))])
    engine = kiln.build(model, autotune=False, tactic_sources="codegen,torch", min_shapes="x:1x8x2x2",
                        opt_shapes="x:2x8x8x8", max_shapes="x:4x8x16x16")
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("PointWise", "codegen.pointwise_c_simd")]
    for shape in ((1, 8, 2, 2), (3, 8, 5, 7), (4, 8, 16, 16)):
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0], rel=1e-5)


@pytest.mark.parametrize("b_type,b_zero_point", [(np.uint8, 128), (np.int8, -5)])
def test_a_dynamic_quantized_sum_in_a_model_matches_onnxruntime_exactly(b_type, b_zero_point):
    h = helper.make_node
    nodes = [h("DequantizeLinear", ["a", "a_s", "a_z"], ["af"]), h("DequantizeLinear", ["b", "b_s", "b_z"], ["bf"]),
             h("Add", ["af", "bf"], ["s"]), h("QuantizeLinear", ["s", "y_s", "y_z"], ["y"])]
    inits = [init("a_s", np.float32(0.03)), init("a_z", np.uint8(120)), init("b_s", np.float32(0.07)),
             init("b_z", b_type(b_zero_point)), init("y_s", np.float32(0.06)), init("y_z", np.uint8(10))]
    b_proto = TensorProto.UINT8 if b_type is np.uint8 else TensorProto.INT8
    model = make_model(nodes, [helper.make_tensor_value_info("a", TensorProto.UINT8, ["b", "s", 40]),
                               helper.make_tensor_value_info("b", b_proto, ["b", "s", 40])],
                       [helper.make_tensor_value_info("y", TensorProto.UINT8, ["b", "s", 40])], inits)
    engine = kiln.build(model, autotune=False, tactic_sources="codegen,torch", min_shapes="a:1x1x40,b:1x1x40",
                        opt_shapes="a:1x16x40,b:1x16x40", max_shapes="a:2x64x40,b:2x64x40")
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("QAdd", "codegen.pointwise_c_simd")]
    rng = np.random.default_rng(3)
    for shape in ((1, 1, 40), (2, 37, 40), (2, 64, 40)):
        feeds = {"a": rng.integers(0, 256, shape).astype(np.uint8),
                 "b": rng.integers(np.iinfo(b_type).min, np.iinfo(b_type).max + 1, shape).astype(b_type)}
        np.testing.assert_array_equal(engine.run(feeds)["y"], unfused_onnxruntime(model, feeds))
