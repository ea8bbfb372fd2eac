"""BF16 tensors between layers (kiln.tactics.storage): which tensors a BF16 plan stores in bf16, what layer info says
of them, the kernels reading and writing them (against the formula and onnxruntime's FP32), engines saved and
loaded with them, and kernels without bf16 I/O (another CPU's fallback, the accuracy budget's FP32 stand-ins)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import kiln
from kiln import hardware, native
from kiln.plan.model import Arg, Layer, TensorDesc
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, Conv1x1GemmBf16Tactic, DirectConvBf16Tactic, MatMulGemmBf16Tactic
from kiln.tactics.onednn_conv import OneDnnBf16ConvTactic, bf16_available
from kiln.tactics.storage import bf16_tensors, native_view, with_conversions
from tests.conftest import cosine, init, make_model, rand, run_ort

needs_bf16 = pytest.mark.skipif(not (hardware.has_any(BF16_DOT_ISA) and native.available()),
                                reason="this CPU has no AVX512-BF16 (vdpbf16ps) or there is no C compiler: kiln's "
                                "BF16 kernels, which read and write bf16 tensors, are not offered here")
KILN_ONLY = "-openvino,-onnxruntime,-torch-onednn,-onednn"
BF16_TYPES = ("Channel major BF16 format", "Row major linear BF16 format")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


# ---- the rule, on hand-made layers -------------------------------------------------------------------------------

def _layer(name, tactic, ins, out, precision="BF16"):
    descs = tuple(TensorDesc(t, (1, 8), "float32") for t in ins)
    return Layer(name, "Conv", "", tuple(Arg("tensor", t) for t in ins), descs, (TensorDesc(out, (1, 8), "float32"),),
                 {}, tactic, 0, "kiln", (), precision=precision)


def test_a_tensor_is_bf16_only_between_a_bf16_writer_and_bf16_readers():
    bf, fp = "kiln.conv2d_1x1_gemm_nhwc_bf16", "kiln.conv2d_1x1_gemm_nhwc"
    layers = [_layer("a", bf, ["x"], "ta"),              # read by two BF16 kernels at input 0: bf16
              _layer("b", bf, ["ta"], "tb"),             # read by an FP32 kernel: FP32
              _layer("c", bf, ["ta"], "tc"),             # read by a BF16 kernel at input 1 (not a bf16 input): FP32
              _layer("d", fp, ["tb"], "td"),             # FP32 kernel: never writes bf16
              _layer("e", bf, ["td", "tc"], "te"),       # tc as input 1 (a weight slot): not a bf16 input
              _layer("f", bf, ["te"], "y"),              # an engine output: FP32
              _layer("g", bf, ["y"], "tg", precision="FP32")]   # granted FP32 on a BF16-capable tactic: FP32
    assert bf16_tensors(layers, {"y", "tg"}) == {"ta", "te"}


def test_a_layout_reformat_carries_bf16_where_its_readers_take_it():
    """A Reformat copies any dtype: its input and output are bf16 when the writer writes bf16 and every reader of
    its output reads bf16; one FP32 reader keeps both FP32 (the Reformat does not convert)."""
    bf = "kiln.conv2d_1x1_gemm_nhwc_bf16"

    def reformat(name, src, out):
        return dataclasses.replace(_layer(name, "kiln.reformat_copy", [src], out, precision="FP32"),
                                   op_type="Reformat")
    layers = [_layer("a", bf, ["x"], "ta"), reformat("r1", "ta", "ra"), _layer("b", bf, ["ra"], "tb"),
              _layer("c", bf, ["tb"], "tc"), reformat("r2", "tc", "rc"), reformat("r3", "rc", "rr"),
              _layer("d", "kiln.conv2d_1x1_gemm_nhwc", ["rr"], "td"), _layer("e", bf, ["td"], "y")]
    assert bf16_tensors(layers, {"y"}) == {"ta", "ra", "tb"}   # r2 -> r3 -> an FP32 reader: tc, rc, rr FP32


def test_kernels_without_bf16_io_get_conversions_around_them():
    from kiln.tactics.reference import ReferenceTactic

    view = LayerView("Relu", "", {}, ((2, 3),), ("bfloat16",), {}, ("bfloat16",), 17, ((),))
    seen, widen, narrow = native_view(view, ReferenceTactic())
    assert (seen.input_dtypes, seen.output_dtypes, widen, narrow) == (("float32",), ("float32",), (0,), (0,))
    kernel = with_conversions(lambda xs: [xs[0] * 2], widen, narrow)
    y = kernel([torch.tensor([1.5, -3.0], dtype=torch.bfloat16)])[0]
    assert y.dtype == torch.bfloat16 and y.tolist() == [3.0, -6.0]
    assert native_view(view, Conv1x1GemmBf16Tactic())[1:] == ((), ())   # reads and writes bf16 itself


# ---- the C kernels with bf16 input, residual and output ----------------------------------------------------------

def _dtypes(x_bf16, out_bf16, res_bf16, residual):
    ins = ["bfloat16" if x_bf16 else "float32", "float32", "float32"]
    if residual:
        ins.append("bfloat16" if res_bf16 else "float32")
    return tuple(ins), ("bfloat16" if out_bf16 else "float32",)


@needs_bf16
@pytest.mark.parametrize("x_bf16,out_bf16,res_bf16", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0)])
@pytest.mark.parametrize("k,c,stride,pads", [(1, 64, 1, (0, 0, 0, 0)), (1, 45, 2, (0, 0, 0, 0)),
                                             (3, 16, 1, (1, 1, 1, 1)), (7, 3, 2, (3, 3, 3, 3))])
def test_bf16_kernels_read_and_write_the_types_the_plan_stores(x_bf16, out_bf16, res_bf16, k, c, stride, pads):
    g = torch.Generator().manual_seed(21)
    cout, hw = 40, 9                                   # a partial panel; odd channel counts pair with a zero
    weight, bias = torch.randn(cout, c, k, k, generator=g), torch.randn(cout, generator=g)
    x = torch.randn(2, c, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    want = F.conv2d(bf16(F.pad(x, [pads[1], pads[3], pads[0], pads[2]])), bf16(weight), bias, stride)
    r = torch.randn(want.shape, generator=g).contiguous(memory_format=torch.channels_last)
    r = r.bfloat16() if res_bf16 else r
    want = torch.relu(want + r.float())
    ins, outs = _dtypes(x_bf16, out_bf16, res_bf16, True)
    shapes = ((2, c, hw, hw), tuple(weight.shape), (cout,), tuple(want.shape))
    attrs = {"kernel_shape": [k, k], "pads": list(pads), "strides": [stride] * 2, "dilations": [1, 1], "group": 1,
             "activation": {"op": "Relu", "attrs": {}}}
    view = LayerView("Conv", "", attrs, shapes, ins, {1: weight, 2: bias}, outs, 17, tuple(() for _ in shapes))
    tactic = Conv1x1GemmBf16Tactic() if k == 1 else DirectConvBf16Tactic()
    assert tactic.supports(dataclasses.replace(view, input_dtypes=("float32",) * 4, output_dtypes=("float32",)))
    got = tactic.prepare(view)([x.bfloat16() if x_bf16 else x, None, None, r])[0]
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32) and got.shape == want.shape
    tol = 1 / 128 if out_bf16 else 1e-4                # a bf16 output is the FP32 result rounded to 8 bits
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 (AVX512-BF16 or AMX) or oneDNN does not "
                    "use it: oneDNN's BF16 convolution is not offered")
@pytest.mark.parametrize("res_bf16,out_bf16", [(0, 0), (1, 1), (1, 0)])
def test_onednn_bf16_conv_adds_a_residual_as_the_plan_stores_it(res_bf16, out_bf16):
    """An FP32-stored residual (its producer kept FP32, by a budget or --layer-precisions) is added in FP32 after
    oneDNN's BF16 call, then the activation: rounded to bf16, r = ±1000 + noise would be off by up to 2."""
    g = torch.Generator().manual_seed(23)
    weight, bias = torch.randn(24, 16, 3, 3, generator=g) * 0.1, torch.randn(24, generator=g)
    x = torch.randn(1, 16, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    product = F.conv2d(bf16(x), bf16(weight), bias, padding=1)
    r = (torch.randn(product.shape, generator=g) + 1000 * torch.randn(product.shape, generator=g).sign())
    r = r.contiguous(memory_format=torch.channels_last)
    r = r.bfloat16() if res_bf16 else r
    ins, outs = _dtypes(0, out_bf16, res_bf16, True)
    attrs = {"kernel_shape": [3, 3], "pads": [1] * 4, "strides": [1, 1], "dilations": [1, 1], "group": 1,
             "activation": {"op": "Relu", "attrs": {}}}
    shapes = ((1, 16, 8, 8), tuple(weight.shape), (24,), tuple(product.shape))
    view = LayerView("Conv", "", attrs, shapes, ins, {1: weight, 2: bias}, outs, 17, tuple(() for _ in shapes))
    got = OneDnnBf16ConvTactic().prepare(view)([x, None, None, r])[0]
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    want = torch.relu(product + r.float())
    tol = dict(rtol=1 / 128, atol=0.1) if out_bf16 else dict(rtol=0, atol=0.1)   # the product's own bf16 rounding
    torch.testing.assert_close(got.float(), want, **tol)


@needs_bf16
@pytest.mark.parametrize("k", [48, 33])
def test_bf16_linear_reads_and_writes_bf16(k):
    g = torch.Generator().manual_seed(22)
    w, x = torch.randn(k, 40, generator=g), torch.randn(7, k, generator=g).bfloat16()
    view = LayerView("MatMul", "", {}, ((7, k), (k, 40)), ("bfloat16", "float32"), {1: w}, ("bfloat16",), 17,
                     ((), ()))
    got = MatMulGemmBf16Tactic().prepare(view)([x, None])[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ bf16(w), rtol=1 / 128, atol=1 / 64)


# ---- whole plans -------------------------------------------------------------------------------------------------

def conv_chain() -> bytes:
    """x -> 1x1 -> 1x1+ReLU -> 5x5 -> 1x1 -> (+ 1x1 of the first) -> ReLU, and a sum over H and W (Einsum: no BF16
    kernel) reading the first conv's output too."""
    convs = [("c1", "x", 16, 48, 1, "a"), ("c2", "a", 48, 48, 1, "b0"), ("c3", "b", 48, 48, 5, "c"),
             ("c4", "c", 48, 32, 1, "d"), ("c5", "a", 48, 32, 1, "e")]
    nodes, inits = [], []
    for name, src, cin, cout, k, out in convs:
        inits += [init(f"{name}_w", rand((cout, cin, k, k), seed=len(inits)) * 0.15),
                  init(f"{name}_b", rand((cout,), seed=len(inits) + 1) * 0.1)]
        nodes.append(helper.make_node("Conv", [src, f"{name}_w", f"{name}_b"], [out], name=name, pads=[k // 2] * 4))
        if name == "c2":
            nodes.append(helper.make_node("Relu", ["b0"], ["b"], name="r1"))
    nodes += [helper.make_node("Add", ["d", "e"], ["f"], name="add"), helper.make_node("Relu", ["f"], ["y"], name="r2"),
              helper.make_node("Einsum", ["a"], ["p"], name="pool", equation="nchw->nc")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                       helper.make_tensor_value_info("p", TensorProto.FLOAT, None)], inits)


@pytest.fixture(scope="module")
def chain():
    model = conv_chain()
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off")
    return model, engine


def stored_dtypes(engine) -> dict[str, str]:
    return {t.name: t.dtype for layer in engine.plan.layers for t in (*layer.inputs, *layer.outputs)}


@needs_bf16
def test_tensors_between_bf16_kernels_are_stored_in_bf16_and_layer_info_says_so(chain):
    model, engine = chain
    dtypes = stored_dtypes(engine)
    # a: read by BF16 kernels and the FP32 Einsum -> FP32; b (c2+r1 -> c3), c (c3 -> c4), d (c4 -> c5's residual)
    assert {name for name, d in dtypes.items() if d == "bfloat16"} == {"b", "c", "d"}
    assert dtypes["x"] == dtypes["a"] == "float32" and all(t.dtype == "float32" for t in engine.plan.outputs)
    info = {layer["Name"]: layer for layer in engine.layer_info()["Layers"]}
    assert info["c3"]["Inputs"][0]["Format/Datatype"] == "Channel major BF16 format"
    assert info["c3"]["Outputs"][0]["Format/Datatype"] == "Channel major BF16 format"
    assert info["c1"]["Outputs"][0]["Format/Datatype"] == "Channel major FP32 format"
    got = engine.run({"x": rand((1, 16, 12, 12), seed=5)})
    want = run_ort(model, {"x": rand((1, 16, 12, 12), seed=5)})
    for name, ref in zip(("y", "p"), want):
        assert got[name].dtype == np.float32 and cosine(got[name], ref) > 0.9999


@needs_bf16
def test_the_autotuner_is_told_which_neighbours_store_bf16(monkeypatch):
    from kiln.tactics.autotune import Autotuner
    from kiln.tactics.registry import reduced_precisions
    seen, choose = {}, Autotuner.choose

    def spy(self, name, view, tactics, *args, **kwargs):
        seen[name] = args[4] if len(args) > 4 else kwargs.get("stored")   # (have, names, dying, precision, stored)
        return choose(self, name, view, tactics, *args, **kwargs)
    monkeypatch.setattr(Autotuner, "choose", spy)
    # BF16 is allowed, not required: each layer's FP32 kernels race its BF16 ones, and c2, c3 and c4 write bf16 only
    # where a BF16 kernel wins them (c2's won by ~35% on a Zen 4, within reach of a noisy host). BF16 kernels timed
    # faster everywhere, what each layer is told follows from the storage guess, not from this host's timing
    monkeypatch.setattr(Autotuner, "_measure", lambda self, views, tactics, *args: {
        t.name: 1.0 if "BF16" in reduced_precisions(t) else 2.0 for t in tactics})
    kiln.build(conv_chain(), bf16=True, tactic_sources=KILN_ONLY, accuracy="off")
    # c1 reads the engine input and feeds the FP32 Einsum, so c2 and c5 read its output in FP32 too; c2 feeds c3,
    # granted BF16; c3 reads c2's bf16 output (after the fused ReLU) and feeds c4; c5 ends the graph
    assert (seen["c1"].inputs, seen["c1"].output_shape) == (frozenset(), None)
    assert (seen["c2 + r1"].inputs, seen["c2 + r1"].output_shape) == (frozenset(), (1, 48, 12, 12))
    assert (seen["c3"].inputs, seen["c3"].output_shape) == (frozenset({0}), (1, 48, 12, 12))
    assert seen["c4"].inputs == frozenset({0})
    assert (seen["c5 + add + r2"].inputs, seen["c5 + add + r2"].output_shape) == (frozenset({3}), None)


@needs_bf16
def test_an_engine_with_bf16_tensors_saves_loads_and_runs_the_same(chain, tmp_path):
    _, engine = chain
    path = tmp_path / "chain.kiln"
    engine.save(path)
    loaded = kiln.load(path)
    assert stored_dtypes(loaded) == stored_dtypes(engine)
    feeds = {"x": rand((1, 16, 12, 12), seed=6)}
    for name, value in engine.run(feeds).items():
        np.testing.assert_array_equal(loaded.run(feeds)[name], value)
    sizes = {t.name: t.size_bytes for layer in loaded.plan.layers for t in layer.outputs}
    assert sizes["c"] == 48 * 12 * 12 * 2 and sizes["a"] == 48 * 12 * 12 * 4   # bf16 moves half the bytes


@needs_bf16
def test_bf16_tensors_run_on_a_cpu_without_bf16_through_conversions(chain, tmp_path, monkeypatch):
    model, engine = chain
    path = tmp_path / "chain.kiln"
    engine.save(path)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    loaded = kiln.load(path, allow_other_device=True)   # every BF16 kernel falls back to torch's, in FP32
    feeds = {"x": rand((1, 16, 12, 12), seed=7)}
    got, want = loaded.run(feeds), run_ort(model, feeds)
    assert cosine(got["y"], want[0]) > 0.9999
    seen = {}
    loaded.create_execution_context().execute(feeds, observe=lambda name, t: seen.setdefault(name, t.dtype))
    assert seen["c"] == torch.float32   # observers see a bf16 tensor's values as FP32


@needs_bf16
@pytest.mark.parametrize("skip,x_bf16,skip_bf16,out_bf16", [(True, 1, 1, 1), (True, 0, 1, 0), (False, 1, 0, 1),
                                                             (False, 0, 0, 1)])
def test_bf16_layernorm_reads_and_writes_bf16_and_computes_in_fp32(skip, x_bf16, skip_bf16, out_bf16):
    from kiln.tactics.layernorm_c import LayerNormBf16Tactic

    g = torch.Generator().manual_seed(23)
    x, s = torch.randn(3, 5, 96, generator=g) * 4 + 1, torch.randn(3, 5, 96, generator=g)
    gamma, beta = torch.rand(96, generator=g) + 0.5, torch.randn(96, generator=g)
    x_in, s_in = (x.bfloat16() if x_bf16 else x), (s.bfloat16() if skip_bf16 else s)
    want = F.layer_norm(x_in.float() + (s_in.float() if skip else 0), (96,), gamma, beta, 1e-5)
    acts = (x_in, s_in) if skip else (x_in,)
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in acts) + ("float32", "float32")
    view = LayerView("SkipLayerNormalization" if skip else "LayerNormalization", "kiln" if skip else "",
                     {"axis": -1, "epsilon": 1e-5}, tuple(t.shape for t in acts) + ((96,), (96,)), dtypes,
                     {len(acts): gamma, len(acts) + 1: beta}, ("bfloat16" if out_bf16 else "float32",), 17,
                     tuple(() for _ in range(len(acts) + 2)))
    got = LayerNormBf16Tactic().prepare(view)([*acts, None, None])[0]
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    if out_bf16:   # the FP32 result rounded to nearest even, within an ulp of torch's rounding of its own FP32 result
        torch.testing.assert_close(got.float(), want, rtol=1 / 128, atol=1 / 64)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_bf16
def test_an_encoder_block_keeps_bf16_from_one_gemm_to_the_next():
    from tests.precision.models import transformer_net

    model = transformer_net()
    engine = kiln.build(model, bf16=True, precision_constraints="prefer", accuracy="off")
    by_layer = {layer.name: layer for layer in engine.plan.layers}
    written_bf16 = {name for name, layer in by_layer.items() if layer.outputs[0].dtype == "bfloat16"}
    # q||k||v -> attention -> o_proj + residual1 -> ln -> ffn1 (+GELU) -> ffn2 + residual2: every tensor bf16, the
    # residual sums in the products' stores reading bf16; only residual2's output, the engine's, is FP32
    assert written_bf16 == {"q_proj || k_proj || v_proj", "k_t + scores + scale_mul + softmax + attn",
                            "o_proj + residual1", "ln", "ffn1 + gelu_div + gelu_erf + gelu_add + gelu_mul + gelu_half"}
    assert by_layer["ffn2 + residual2"].args[3].name == "res1" and by_layer["ffn2 + residual2"].precision == "BF16"
    assert by_layer["ln"].tactic_name == "kiln.layernorm_rows_bf16" and by_layer["ln"].precision == "BF16"
    x = rand((1, 8, 16), seed=9)
    assert cosine(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]) >= 0.999


def test_the_budgets_emulation_adds_a_convolutions_residual_as_stored():
    """The accuracy budget ranks each BF16 layer by its harm alone, emulated around its FP32 kernel: the input,
    weights and bias rounded to bf16, but a convolution's fused residual added as stored (oneDNN's BF16 convolution
    adds an FP32-stored residual in FP32), so a residual of +-1000 costs nothing here where rounding it would cost
    up to 4."""
    from kiln.planning.accuracy import _rounded_around
    from kiln.runtime.prepare import TorchWeights

    x_info, r_info = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 6, 6]) for n in ("x", "r"))
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                        helper.make_node("Add", ["c", "r"], ["y"], name="add")],
                       [x_info, r_info], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("w", rand((8, 8, 3, 3), 1) / 8), init("b", rand((8,), 2))])
    engine = kiln.build(model, autotune=False, tactic_sources="torch")   # the reference kernel: NCHW on every CPU
    (conv,) = [l for l in engine.plan.layers if l.op_type == "Conv"]
    assert [a.kind for a in conv.args] == ["tensor", "weight", "weight", "tensor"]   # the residual fused, input 3
    weights = TorchWeights(engine.plan.weights)
    emulated = _rounded_around(conv, dataclasses.replace(conv, precision="BF16"), weights, engine.plan.weights, 17)
    x = torch.from_numpy(rand((1, 8, 6, 6), 3))
    r = torch.from_numpy(np.where(rand((1, 8, 6, 6), 4) > 0, 1000.0, -1000.0).astype(np.float32)) + \
        torch.from_numpy(rand((1, 8, 6, 6), 5))
    got = emulated([x, None, None, r])[0]
    w, b = (weights[a.name] for a in conv.args[1:3])
    product = F.conv2d(bf16(x), bf16(w), bf16(b), padding=1)
    torch.testing.assert_close(got - r, product, rtol=0, atol=3e-4)   # input, weights, bias rounded; r exact
    assert (product + bf16(r) - got).abs().max() > 0.5   # what rounding the residual would have done
