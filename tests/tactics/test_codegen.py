"""Generated C pointwise kernels (source "codegen"): every op against onnxruntime, broadcasting and
layouts, NaN propagation, refusal of damaged programs, the kernel cache, the missing-compiler path, and a model
forced onto the source matching onnxruntime before and after save/load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware, native
from kiln.errors import EngineFormatError
from kiln.tactics import codegen
from kiln.tactics.base import HWC, LINEAR, LayerView
from kiln.tactics.codegen import CodegenPointWiseTactic
from kiln.tactics.pointwise_c import LoopNest, expressible, loop_nest
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort
from kiln.trt.vocab import layer_type
from tests.native.helpers import hide_compiler

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler that builds OpenMP shared libraries")

TACTIC = CodegenPointWiseTactic()


def view(program, shapes, consts=None):
    return LayerView("PointWise", "kiln", {"program": program}, tuple(shapes), ("float32",) * len(shapes),
                     consts or {}, ("float32",), 17, ((),) * len(shapes))


def one(op, attrs=None, extra=()):
    return [{"op": op, "attrs": attrs or {}, "args": ["x0", *extra]}]


UNARY = ["Relu", "Sigmoid", "Tanh", "Softplus", "Softsign", "HardSwish", "Mish", "Exp", "Neg", "Abs", "Erf",
         "Floor", "Ceil", "Round", "Sin", "Cos", "Identity"]
WITH_ATTRS = [("LeakyRelu", {"alpha": 0.2}), ("Elu", {"alpha": 0.7}), ("Selu", {}), ("HardSigmoid", {"alpha": 0.3}),
              ("ThresholdedRelu", {"alpha": 0.4}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"})]
POSITIVE = ["Sqrt", "Log", "Reciprocal"]


def onnxruntime_op(op, attrs, inputs):
    """One ONNX node run by onnxruntime (opset 20: Gelu's first)."""
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(x.shape))
                                for n, x in zip(names, inputs)],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=20)
    return torch.from_numpy(run_ort(model, {n: x.numpy() for n, x in zip(names, inputs)})[0])


def generated(op, attrs, inputs):
    v = view([{"op": op, "attrs": attrs, "args": [f"x{i}" for i in range(len(inputs))]}],
             [tuple(x.shape) for x in inputs])
    assert TACTIC.supports(v)
    return TACTIC.prepare(v)(inputs)[0]


@pytest.mark.parametrize("op, attrs", [(op, {}) for op in UNARY + POSITIVE] + WITH_ATTRS)
def test_unary_ops_match_onnxruntime(op, attrs):
    x = torch.randn(3, 37, 41, generator=torch.Generator().manual_seed(0)) * 4   # 4551: one thread, a tail
    if op in POSITIVE:
        x = x.abs() + 0.05
    torch.testing.assert_close(generated(op, attrs, [x]), onnxruntime_op(op, attrs, [x]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Pow", "PRelu"])
def test_binary_ops_with_broadcast_match_onnxruntime(op):
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 16, 9, 11, generator=g) + 0.5
    b = torch.rand(16, 1, 11, generator=g) + 0.5
    got = generated(op, {}, [a, b])
    assert got.shape == (2, 16, 9, 11)
    torch.testing.assert_close(got, onnxruntime_op(op, {}, [a, b]), rtol=1e-5, atol=1e-6)


def test_a_chain_with_constants_scalars_and_clip_bounds():
    program = [{"op": "Sigmoid", "attrs": {}, "args": ["x0"]},
               {"op": "Mul", "attrs": {}, "args": ["t0", "x0"]},
               {"op": "Add", "attrs": {}, "args": ["t1", "x1"]},            # per-channel constant
               {"op": "Mul", "attrs": {}, "args": ["t2", "x2"]},            # one-element constant: a literal
               {"op": "Clip", "attrs": {}, "args": ["t3", {"const": -0.5}, {"const": 1.5}]},
               {"op": "Pow", "attrs": {}, "args": ["t4", "x3"]}]            # exponent 2: a square
    x = torch.randn(1, 24, 70, 70)   # 117600 elements: split among threads
    consts = {1: torch.randn(24, 1, 1), 2: torch.tensor([0.75]), 3: torch.tensor(2.0)}
    shapes = [(1, 24, 70, 70), (24, 1, 1), (1,), ()]
    v = view(program, shapes, consts)
    assert TACTIC.input_formats(v) == ["any"] * 4   # the per-channel constant is permuted for channel-major x
    kernel = TACTIC.prepare(v)
    xd = x.double()
    want = ((torch.sigmoid(xd) * xd + consts[1].double()) * 0.75).clamp(-0.5, 1.5) ** 2   # in float64
    for layout in (torch.contiguous_format, torch.channels_last):
        got = kernel([x.contiguous(memory_format=layout), None, None, None])[0]
        assert got.is_contiguous(memory_format=layout)
        torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=2e-6)
    assert "0.75f" in kernel.generated_source   # the scalar is compiled in


@pytest.mark.parametrize("other_shape", [(2, 24, 1, 1), (2, 1, 9, 11), (24, 1, 1), (9, 11), (1, 1, 11), (24, 9, 11)])
def test_broadcasts_on_channel_major_tensors(other_shape):
    """A squeeze-excite scale [N,C,1,1], a spatial mask [N,1,H,W] and lower-rank operands broadcast against a
    channel-major tensor without a Reformat; the output keeps its layout. A [C,H,W] tensor read per call would need
    a transpose of its own: that layer takes linear inputs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 9, 11, generator=g).contiguous(memory_format=torch.channels_last)
    other = torch.randn(other_shape, generator=g)
    program = [{"op": "Mul", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Sigmoid", "attrs": {}, "args": ["t0"]}]
    v = view(program, [tuple(x.shape), other_shape])
    free = other_shape != (24, 9, 11)
    assert TACTIC.input_formats(v) == (["any"] * 2 if free else [LINEAR] * 2)
    assert TACTIC.output_format(v, [HWC, LINEAR]) == (HWC if free else LINEAR)
    got = TACTIC.prepare(v)([x if free else x.contiguous(), other])[0]
    assert got.is_contiguous(memory_format=torch.channels_last if free else torch.contiguous_format)
    torch.testing.assert_close(got, torch.sigmoid(x * other), rtol=1e-6, atol=1e-6)
    as_constant = view(program, [tuple(x.shape), other_shape], {1: other})   # constants: permuted once
    assert TACTIC.input_formats(as_constant) == ["any", "any"]
    got = TACTIC.prepare(as_constant)([x, None])[0]
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, torch.sigmoid(x * other), rtol=1e-6, atol=1e-6)


def test_loop_nest_merges_axes_that_broadcast_alike():
    assert loop_nest((1, 64, 56, 56), [(1, 64, 56, 56), (64, 1, 1)]) == LoopNest((64, 3136), ((3136, 1), (1, 0)))
    assert loop_nest((2, 3, 4), [(2, 3, 4), (2, 3, 4)]) == LoopNest((24,), ((1,), (1,)))
    assert loop_nest((4, 5), [(4, 1), (1, 5)]) == LoopNest((4, 5), ((1, 0), (0, 1)))


def test_same_shape_inputs_keep_the_channels_last_layout():
    program = [{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Relu", "attrs": {}, "args": ["t0"]}]
    v = view(program, [(1, 8, 5, 6)] * 2)
    assert TACTIC.input_formats(v) == ["any", "any"] and TACTIC.output_format(v, [HWC, HWC]) == HWC
    a = torch.randn(1, 8, 5, 6).contiguous(memory_format=torch.channels_last)
    b = torch.randn(1, 8, 5, 6)   # a different layout: read in the first input's
    got = TACTIC.prepare(v)([a, b])[0]
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, torch.relu(a + b), rtol=0, atol=0)


def test_nan_propagates_as_in_torch():
    x = torch.tensor([float("nan"), 1.0, -2.0, float("inf"), -float("inf")])
    y = torch.tensor([0.0, float("nan"), -3.0, 1.0, 2.0])
    for op, fn in (("Max", torch.maximum), ("Min", torch.minimum)):
        got = generated(op, {}, [x, y])
        torch.testing.assert_close(got, fn(x, y), equal_nan=True)
    for op, attrs, fn in (("Relu", {}, torch.relu), ("Tanh", {}, torch.tanh), ("Erf", {}, torch.erf),
                          ("Sigmoid", {}, torch.sigmoid), ("Clip", {"min": 0.0, "max": 1.0}, lambda t: t.clamp(0, 1))):
        torch.testing.assert_close(generated(op, attrs, [x]), fn(x), equal_nan=True)


def test_one_kernel_serves_contexts_on_several_threads_at_once():
    """An engine's kernels are shared by the execution contexts of several threads: no per-call state is shared."""
    from concurrent.futures import ThreadPoolExecutor

    program = [{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}, {"op": "Tanh", "attrs": {}, "args": ["t0"]}]
    kernel = TACTIC.prepare(view(program, [(1, 16, 40, 40)] * 2))
    pairs = [(torch.randn(1, 16, 40, 40), torch.randn(1, 16, 40, 40)) for _ in range(4)]

    def run_many(pair):
        return [kernel(list(pair))[0] for _ in range(200)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run_many, pairs))
    for (a, b), outs in zip(pairs, results):
        for out in outs:
            torch.testing.assert_close(out, torch.tanh(a + b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("program", [
    [{"op": "System", "attrs": {}, "args": ["x0"]}],                          # not an op in the table
    [{"op": "LeakyRelu", "attrs": {"alpha": "0); abort(); (0"}, "args": ["x0"]}],  # text where a number goes
    [{"op": "Add", "attrs": {}, "args": ["x0", "x7"]}],                       # an input that does not exist
    [{"op": "Relu", "attrs": {}, "args": ["t3"]}],                            # a step not computed yet
    [{"op": "Cast", "attrs": {"to": TensorProto.INT32}, "args": ["x0"]}],     # leaves float
    [],
])
def test_damaged_programs_are_declined_and_refused_at_load(program):
    v = view(program, [(4, 4), (4, 4)])
    assert not TACTIC.supports(v)
    if program and program[0]["op"] != "Cast":
        with pytest.raises(EngineFormatError, match="PointWise program"):
            TACTIC.prepare(v)


def test_declines_non_float_inputs():   # dynamic shapes: test_codegen_shaped.py
    program = one("Relu")
    ints = LayerView("PointWise", "kiln", {"program": program}, ((1, 8),), ("int64",), {}, ("int64",), 17, ((),))
    assert not TACTIC.supports(ints)
    assert expressible(program, 1)


def test_compiled_kernels_are_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        program = one("HardSigmoid", {"alpha": 0.123})
        x = torch.randn(10, 10)
        first = TACTIC.prepare(view(program, [(10, 10)]))([x])[0]
        files = sorted((tmp_path / "kernels").glob("pointwise-*.so"))
        assert len(files) == 1
        mtime, listing = files[0].stat().st_mtime_ns, sorted((tmp_path / "kernels").iterdir())
        native.reset()   # a new process: the library is mapped again, not rebuilt
        again = TACTIC.prepare(view(program, [(10, 10)]))([x])[0]
        assert files[0].stat().st_mtime_ns == mtime and sorted((tmp_path / "kernels").iterdir()) == listing
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    finally:
        native.reset()


def test_without_a_compiler_the_source_is_unavailable(monkeypatch):
    """(An engine built elsewhere still runs its generated layers: tests/tactics/test_no_compiler.py.)"""
    from kiln.tactics.registry import available_sources, parse_sources
    from kiln.errors import Error

    hide_compiler(monkeypatch)
    try:
        assert "codegen" not in available_sources()
        with pytest.raises(Error, match="'codegen' is not available"):
            parse_sources("+codegen")
        assert not TACTIC.supports(view(one("Sigmoid"), [(3, 5)]))
    finally:
        native.reset()


def swish_model():
    """x*sigmoid(x) + b, then tanh-GELU spelled out: two fused PointWise layers around a MatMul (with GeluFusion
    off; on, the GELU becomes the MatMul's activation)."""
    c = 0.7978845608028654
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["sw"]),
             helper.make_node("Add", ["sw", "b"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["m"]),
             helper.make_node("Mul", ["m", "m"], ["m2"]), helper.make_node("Mul", ["m2", "m"], ["m3"]),
             helper.make_node("Mul", ["m3", "k"], ["m3k"]), helper.make_node("Add", ["m", "m3k"], ["inner"]),
             helper.make_node("Mul", ["inner", "c"], ["ic"]), helper.make_node("Tanh", ["ic"], ["t"]),
             helper.make_node("Add", ["t", "one"], ["t1"]), helper.make_node("Mul", ["m", "t1"], ["mt"]),
             helper.make_node("Mul", ["mt", "half"], ["y"])]
    inits = [init("b", rand((64,), 1)), init("w", rand((64, 96), 2) * 0.1), init("k", np.float32(0.044715)),
             init("c", np.float32(c)), init("one", np.float32(1.0)), init("half", np.float32(0.5))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128, 64])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128, 96])], inits)


def test_model_forced_onto_codegen_matches_onnxruntime(tmp_path):
    model = swish_model()
    engine = kiln.build(model, tactic_sources=frozenset({"codegen", "torch"}), autotune=False,
                        disabled_passes=["GeluFusion"])
    generated = [l for l in engine.plan.layers if l.tactic_name == "codegen.pointwise_c_simd"]
    assert len(generated) == 2 and all(layer_type(l) == "PointWiseV2" for l in generated)
    feeds = {"x": rand((2, 128, 64), 3)}
    expected = run_ort(model, feeds)[0]
    assert_close_to_ort(engine.run(feeds)["y"], expected)
    info = engine.layer_info("detailed")
    names = {l["TacticName"] for l in info["Layers"] if l.get("LayerType") == "PointWiseV2"}
    assert names == {"codegen.pointwise_c_simd"}, names
    engine.save(tmp_path / "m.kiln")
    again = kiln.load(tmp_path / "m.kiln")
    np.testing.assert_array_equal(again.run(feeds)["y"], engine.run(feeds)["y"])


@pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA), reason="BF16 tactics are offered only on BF16 CPUs")
@pytest.mark.parametrize("x_bf16,y_bf16,out_bf16", [(1, 1, 1), (1, 0, 0), (0, 1, 1), (0, 0, 1)])
def test_bf16_storage_programs_compute_in_fp32_and_round_only_the_output(x_bf16, y_bf16, out_bf16):
    """x * sigmoid(x) + y + a per-channel constant, broadcast and flat inputs in either storage type."""
    program = [{"op": "Sigmoid", "attrs": {}, "args": ["x0"]}, {"op": "Mul", "attrs": {}, "args": ["t0", "x0"]},
               {"op": "Add", "attrs": {}, "args": ["t1", "x1"]}, {"op": "Add", "attrs": {}, "args": ["t2", "x2"]}]
    g = torch.Generator().manual_seed(51)
    x, y, c = torch.randn(2, 24, 9, 70, generator=g), torch.randn(24, 1, 70, generator=g), torch.randn(24, 1, 1)
    x, y = (x.bfloat16() if x_bf16 else x), (y.bfloat16() if y_bf16 else y)
    stored = lambda bf16: "bfloat16" if bf16 else "float32"  # noqa: E731
    v = LayerView("PointWise", "kiln", {"program": program}, ((2, 24, 9, 70), (24, 1, 70), (24, 1, 1)),
                  (stored(x_bf16), stored(y_bf16), "float32"), {2: c}, (stored(out_bf16),), 17, ((),) * 3)
    tactic = codegen.CodegenPointWiseBf16Tactic()
    assert tactic.supports(v) and not TACTIC.supports(v)   # the FP32 tactic reads and writes FP32 only
    got = tactic.prepare(v)([x, y, None])[0]
    xd = x.double()
    want = torch.sigmoid(xd) * xd + y.double() + c.double()
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    tol = 2 ** -8 if out_bf16 else 2e-6   # a bf16 output: the FP32 result rounded once
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA), reason="BF16 tactics are offered only on BF16 CPUs")
def test_bf16_squeeze_excite_scale_keeps_channel_major_bf16():
    """x * sigmoid(s) with x [N,C,H,W] channel-major bf16 and s [N,C,1,1]: no Reformat, one rounding."""
    program = [{"op": "Sigmoid", "attrs": {}, "args": ["x1"]}, {"op": "Mul", "attrs": {}, "args": ["x0", "t0"]}]
    g = torch.Generator().manual_seed(52)
    x = torch.randn(1, 40, 13, 17, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
    s = torch.randn(1, 40, 1, 1, generator=g)
    v = LayerView("PointWise", "kiln", {"program": program}, ((1, 40, 13, 17), (1, 40, 1, 1)),
                  ("bfloat16", "float32"), {}, ("bfloat16",), 17, ((),) * 2)
    tactic = codegen.CodegenPointWiseBf16Tactic()
    assert tactic.input_formats(v) == ["any", "any"] and tactic.output_format(v, [HWC, LINEAR]) == HWC
    got = tactic.prepare(v)([x, s])[0]
    assert got.dtype == torch.bfloat16 and got.is_contiguous(memory_format=torch.channels_last)
    want = x.double() * torch.sigmoid(s.double())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=2 ** -8)


def batchnorm_view(program, x_shape, c):
    g = torch.Generator().manual_seed(53)
    params = {1: torch.rand(c, generator=g) + 0.5, 2: torch.randn(c, generator=g), 3: torch.randn(c, generator=g),
              4: torch.rand(c, generator=g) + 0.1}
    return view(program, [x_shape] + [(c,)] * 4, params), params


BATCHNORM = {"op": "BatchNormalization", "attrs": {"epsilon": 1e-3}, "args": ["x0", "x1", "x2", "x3", "x4"]}


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_a_batchnorm_step_runs_as_a_per_channel_scale_and_shift(layout):
    """Pre-activation BatchNormalization + ReLU (DenseNet, pre-act ResNets: nothing to fold into): its [C]
    parameters become [C,1,1] scale and shift, so the program broadcasts, in either layout."""
    v, p = batchnorm_view([BATCHNORM, {"op": "Relu", "attrs": {}, "args": ["t0"]}], (2, 40, 9, 13), 40)
    assert TACTIC.supports(v) and TACTIC.input_formats(v) == ["any"] * 5
    x = torch.randn(2, 40, 9, 13, generator=torch.Generator().manual_seed(54)).contiguous(memory_format=layout)
    got = TACTIC.prepare(v)([x, None, None, None, None])[0]
    xd, (gamma, beta, mean, var) = x.double(), (p[i].double() for i in range(1, 5))
    want = torch.relu(torch.nn.functional.batch_norm(xd, mean, var, gamma, beta, eps=1e-3))
    assert got.is_contiguous(memory_format=layout)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_lone_batchnorm_layer_is_a_one_step_program():
    v, p = batchnorm_view([], (1, 24, 5, 5), 24)
    lone = LayerView("BatchNormalization", "", {"epsilon": 1e-5}, v.input_shapes, v.input_dtypes, p, ("float32",), 17,
                     v.input_dynamic)
    assert TACTIC.supports(lone)
    x = torch.randn(1, 24, 5, 5)
    want = torch.nn.functional.batch_norm(x.double(), p[3].double(), p[4].double(), p[1].double(), p[2].double(),
                                          eps=1e-5)
    torch.testing.assert_close(TACTIC.prepare(lone)([x] + [None] * 4)[0].double(), want, rtol=1e-5, atol=1e-5)


def test_a_batchnorm_whose_parameters_are_not_per_channel_constants_is_declined():
    v, _ = batchnorm_view([BATCHNORM], (1, 8, 4, 4), 8)
    runtime_mean = LayerView(v.op_type, v.domain, v.attrs, v.input_shapes, v.input_dtypes,
                             {i: t for i, t in v.const_inputs.items() if i != 3}, v.output_dtypes, 17, v.input_dynamic)
    assert TACTIC.supports(v) and not TACTIC.supports(runtime_mean)
    reused = [BATCHNORM, {"op": "Add", "attrs": {}, "args": ["t0", "x1"]}]   # gamma read again: cannot fold
    assert not TACTIC.supports(batchnorm_view(reused, (1, 8, 4, 4), 8)[0])
    training = [{**BATCHNORM, "attrs": {"training_mode": 1}}]
    assert not TACTIC.supports(batchnorm_view(training, (1, 8, 4, 4), 8)[0])
