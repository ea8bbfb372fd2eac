"""INT8 products of two activations (a Q/DQ model's attention: Q.K^T, then P.V): QuantizeDoubleInputNodes makes the
MatMul one QMatMul reading both INT8 tensors, and kiln's kernel packs B on every call: its exact integer sums and
float32 epilogue equal the formula bit for bit, whatever the signedness and zero points, shapes off the register
tile and panel sizes; a Q/DQ attention block built from ONNX matches onnxruntime's unfused graph."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics import qgemm_act_c
from kiln.tactics.base import LayerView
from kiln.tactics.qgemm_act_c import QActMatMulTactic
from kiln.tactics.qgemm_c import MAX_K_ZERO_POINTS, QLinearGemmTactic, vnni_available
from tests.conftest import make_model, torch_threads, unfused_onnxruntime
from tests.tactics.test_qgemm_c import RANGES, TORCH, needs_vnni, rand_q, requantize

RELU = {"op": "Relu", "attrs": {}}
CASES = {
    # name: (leading dims, m, k, n, x (dtype, zp), b (dtype, zp), y (dtype, zp, scale) or None: FP32 out)
    "attention_scores_u8_u8": ((1, 4), 32, 64, 32, ("uint8", 127), ("uint8", 128), ("uint8", 120, 0.4)),
    "odd_shapes_s8_by_u8": ((2, 3), 13, 37, 45, ("int8", -3), ("uint8", 126), ("int8", 5, 0.05)),
    "u8_by_s8_fp32_out": ((5,), 7, 70, 33, ("uint8", 9), ("int8", -4), None),
    "probabilities_by_values": ((3,), 24, 24, 16, ("uint8", 0), ("uint8", 126), ("uint8", 128, 0.1)),
    "plain_2d": ((), 9, 20, 70, ("uint8", 200), ("int8", 0), ("uint8", 3, 0.6)),
    "small_s8_by_s8": ((2,), 5, 3, 15, ("int8", -5), ("int8", 3), ("int8", 3, 0.15)),   # m < 6, k < 4, n < 16
    "many_heads_two_threads": ((8, 12), 128, 64, 128, ("int8", 1), ("uint8", 131), ("uint8", 128, 0.5)),
}


def act_case(case, bias=None, act=None):
    """(view, a, b) of CASES[case]: x_scale 0.02, b's scale 0.03."""
    lead, m, k, n, x, b, y = CASES[case]
    q = {"x_dtype": x[0], "x_zero_point": x[1], "x_scale": 0.02, "w_scale": [0.03], "w_zero_point": [b[1]],
         "w_axis": 1}
    if y:
        q.update(y_dtype=y[0], y_zero_point=y[1], y_scale=y[2])
    shapes = ((*lead, m, k), (*lead, k, n)) + (((n,),) if bias is not None else ())
    consts = {2: bias} if bias is not None else {}
    view = LayerView("QMatMul", "kiln", {"quant": q, **({"activation": act} if act else {})}, shapes,
                     (x[0], b[0]) + (("float32",) if bias is not None else ()), consts, (y[0] if y else "float32",))
    g = torch.Generator().manual_seed(len(case))
    return view, rand_q(shapes[0], x[0], g), rand_q(shapes[1], b[0], g)


def act_formula(view, a, b):
    """Exact integer sums of (a - a_zp)(b - b_zp), times x_scale * b_scale in float32, [rounded at the mid scale and
    dequantized, + bias, ReLU,] requantized (half to even, saturated) or FP32."""
    q = view.attrs["quant"]
    sums = (a.double() - q["x_zero_point"]) @ (b.double() - q["w_zero_point"][0])
    y = sums.float() * torch.tensor(q["x_scale"] * q["w_scale"][0], dtype=torch.float64).float()
    if "mid_scale" in q:
        lo, hi = RANGES[q["mid_dtype"]]
        mid = torch.clamp(torch.round(y / q["mid_scale"]) + q["mid_zero_point"], lo, hi)
        y = (mid - q["mid_zero_point"]) * torch.tensor(q["mid_scale"], dtype=torch.float32)
    if 2 in view.const_inputs:
        y = y + view.const_inputs[2]
    if view.attrs.get("activation"):
        y = torch.relu(y)
    return requantize(y, q)


@needs_vnni
@pytest.mark.parametrize("case", list(CASES))
def test_product_of_two_int8_activations_equals_its_formula(case):
    view, a, b = act_case(case)
    tactic = QActMatMulTactic()
    assert tactic.supports(view) and not QLinearGemmTactic().supports(view)   # that one needs constant weights
    with torch_threads(2 if "two_threads" in case else 1):   # the packing and GEMM's parallel paths
        got = tactic.prepare(view)([a, b])[0]
    want = act_formula(view, a, b)
    y = CASES[case][-1]
    assert got.dtype == (TORCH[y[0]] if y else torch.float32) and got.shape == want.shape
    assert torch.unique(got).numel() >= 10   # neither saturated nor constant
    assert torch.equal(got.float(), want.float())


@needs_vnni
def test_head_split_and_merge_as_steps_read_and_write_as_the_shuffles_did():
    """Q.K^T of a Q/DQ attention with its head split as steps (kiln.passes.qmatmul_steps): Q [1, S, H*D] read as
    [1, H, S, D], K as [1, H, D, S], the scores written merged [1, S, H*S]; the same as the formula on the moved
    operands, on the kernel and on the reference op."""
    s, h, d = 24, 3, 16
    view, _, _ = act_case("attention_scores_u8_u8")
    steps = {"a_steps": [{"reshape": [1, s, h, d]}, {"transpose": [0, 2, 1, 3]}],
             "b_steps": [{"reshape": [1, s, h, d]}, {"transpose": [0, 2, 3, 1]}],
             "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [1, s, h * s]}]}
    view = dataclasses.replace(view, attrs={**view.attrs, **steps}, input_shapes=((1, s, h * d),) * 2)
    g = torch.Generator().manual_seed(11)
    q, k = rand_q((1, s, h * d), "uint8", g), rand_q((1, s, h * d), "uint8", g)
    heads_q, heads_kt = q.reshape(1, s, h, d).permute(0, 2, 1, 3), k.reshape(1, s, h, d).permute(0, 2, 3, 1)
    want = act_formula(view, heads_q, heads_kt).permute(0, 2, 1, 3).reshape(1, s, h * s)
    tactic = QActMatMulTactic()
    assert tactic.supports(view)
    got = tactic.prepare(view)([q, k])[0]
    assert got.shape == (1, s, h * s) and got.is_contiguous() and torch.unique(got).numel() >= 10
    assert torch.equal(got, want)
    reference = qgemm_act_c.lookup("QMatMul", "kiln").impl   # torch's formula, applying the steps itself
    plain = {key: v for key, v in view.attrs.items() if "steps" not in key}
    assert torch.equal(reference(view.attrs, [q, k])[0],
                       reference(plain, [heads_q, heads_kt])[0].permute(0, 2, 1, 3).reshape(1, s, h * s))
    static = dataclasses.replace(view, attrs=plain, input_shapes=((1, h, s, d), (1, h, d, s)))
    assert tactic.supports(static)
    assert not tactic.supports(dataclasses.replace(view, input_dynamic=((1,), (1,))))   # [1, 24, 3, 16] fixed


@needs_vnni
def test_steps_with_a_dynamic_sequence_run_at_every_length():
    """The same head split written for a dynamic sequence (reshape [0, 0, H, D]; the merge [0, 0, -1], as the
    merged width H * S varies too): the kernel reads the operands' dynamic axes from the steps (the sequence is A's
    rows and B's columns) and applies them per call."""
    h, d = 3, 16
    view, _, _ = act_case("attention_scores_u8_u8")
    steps = {"a_steps": [{"reshape": [0, 0, h, d]}, {"transpose": [0, 2, 1, 3]}],
             "b_steps": [{"reshape": [0, 0, h, d]}, {"transpose": [0, 2, 3, 1]}],
             "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [0, 0, -1]}]}
    view = dataclasses.replace(view, attrs={**view.attrs, **steps}, input_shapes=((1, 24, h * d),) * 2,
                               input_dynamic=((1,), (1,)))
    assert qgemm_act_c.operand_dynamic_axes(view) == [{2}, {3}]
    tactic = QActMatMulTactic()
    assert tactic.supports(view)
    run = tactic.prepare(view)
    g = torch.Generator().manual_seed(12)
    for s in (24, 9, 40):
        q, k = rand_q((1, s, h * d), "uint8", g), rand_q((1, s, h * d), "uint8", g)
        heads_q, heads_kt = q.reshape(1, s, h, d).permute(0, 2, 1, 3), k.reshape(1, s, h, d).permute(0, 2, 3, 1)
        want = act_formula(view, heads_q, heads_kt).permute(0, 2, 1, 3).reshape(1, s, h * s)
        got = run([q, k])[0]
        assert got.shape == (1, s, h * s) and torch.equal(got, want)


@needs_vnni
def test_an_output_table_maps_the_scores_bytes():
    """Q.K^T with quantize_static's scaling as an output table (kiln.passes.qproduct_table): table[byte] of the
    product alone, on the kernel and on the reference op (which the kernel runs for a k past its int32 sums)."""
    view, a, b = act_case("attention_scores_u8_u8")
    bytes_ = torch.randperm(256, generator=torch.Generator().manual_seed(5)).tolist()
    tabled = dataclasses.replace(view, attrs={**view.attrs, "out_table": {"bytes": bytes_, "dtype": "int8"}},
                                 output_dtypes=("int8",))
    plain = QActMatMulTactic().prepare(view)([a, b])[0]
    want = torch.tensor(bytes_, dtype=torch.uint8)[plain.view(torch.uint8).long()].view(torch.int8)
    assert torch.equal(QActMatMulTactic().prepare(tabled)([a, b])[0], want)
    reference = qgemm_act_c.lookup("QMatMul", "kiln").impl
    ref_plain = reference(view.attrs, [a, b])[0]
    assert torch.equal(reference(tabled.attrs, [a, b])[0],
                       torch.tensor(bytes_, dtype=torch.uint8)[ref_plain.view(torch.uint8).long()].view(torch.int8))


@needs_vnni
def test_bias_and_relu_run_in_the_epilogue_and_each_call_packs_its_own_b():
    n = CASES["attention_scores_u8_u8"][3]
    view, a, b = act_case("attention_scores_u8_u8", bias=torch.linspace(-3, 3, n), act=RELU)
    run = QActMatMulTactic().prepare(view)
    assert torch.equal(run([a, b])[0].float(), act_formula(view, a, b).float())
    b2 = torch.flip(b, dims=[-1]).contiguous()   # another B through the same prepared kernel
    assert torch.equal(run([a, b2])[0].float(), act_formula(view, a, b2).float())
    a3, b3 = a[:, :2], b[:, :2]   # fewer heads per call: the leading dimensions are read per call
    assert torch.equal(run([a3.contiguous(), b3.contiguous()])[0].float(), act_formula(view, a3, b3).float())


@needs_vnni
def test_the_kernel_declines_what_it_cannot_run():
    view, _, _ = act_case("odd_shapes_s8_by_u8")
    tactic = QActMatMulTactic()
    assert tactic.supports(view)
    broadcast = LayerView(view.op_type, view.domain, view.attrs, ((2, 3, 13, 37), (1, 3, 37, 45)),
                          view.input_dtypes, {}, view.output_dtypes)
    const_b = LayerView(view.op_type, view.domain, view.attrs, view.input_shapes, view.input_dtypes,
                        {1: torch.zeros(view.input_shapes[1], dtype=torch.uint8)}, view.output_dtypes)
    q = {**view.attrs["quant"], "w_scale": [0.03, 0.04]}
    per_channel = LayerView(view.op_type, view.domain, {"quant": q}, view.input_shapes, view.input_dtypes, {},
                            view.output_dtypes)
    one_side_dynamic = LayerView(view.op_type, view.domain, view.attrs, view.input_shapes, view.input_dtypes, {},
                                 view.output_dtypes, input_dynamic=((0,), ()))
    short_bias = LayerView(view.op_type, view.domain, view.attrs, (*view.input_shapes, (44,)),
                           (*view.input_dtypes, "float32"), {2: torch.zeros(44)}, view.output_dtypes)
    sigmoid = LayerView(view.op_type, view.domain, {**view.attrs, "activation": {"op": "Sigmoid", "attrs": {}}},
                        view.input_shapes, view.input_dtypes, {}, view.output_dtypes)
    residual = LayerView(view.op_type, view.domain, view.attrs, (*view.input_shapes, None, (2, 3, 13, 45)),
                         (*view.input_dtypes, None, "float32"), {}, view.output_dtypes)
    k = MAX_K_ZERO_POINTS + 1   # sums of (x - x_zp)(b - b_zp) past int32
    long_k = LayerView(view.op_type, view.domain, view.attrs, ((2, 3, 13, k), (2, 3, k, 45)), view.input_dtypes, {},
                       view.output_dtypes)
    int32_b = LayerView(view.op_type, view.domain, view.attrs, view.input_shapes, (view.input_dtypes[0], "int32"), {},
                        view.output_dtypes)
    q16 = {**view.attrs["quant"], "y_dtype": "uint16", "y_scale": 0.1, "y_zero_point": 0}
    wide_output = LayerView(view.op_type, view.domain, {"quant": q16}, view.input_shapes, view.input_dtypes, {},
                            ("uint16",))
    def with_quant(**changes):
        return LayerView(view.op_type, view.domain, {"quant": {**view.attrs["quant"], **changes}}, view.input_shapes,
                         view.input_dtypes, {}, view.output_dtypes)
    declined = {"a 16-bit mid rounding": with_quant(mid_dtype="int16", mid_scale=0.1, mid_zero_point=0),
                "per-column B zero points": with_quant(w_zero_point=[0, 1]),
                "an x type other than A's": with_quant(x_dtype="uint8" if view.input_dtypes[0] == "int8" else "int8"),
                "broadcast lead dims": broadcast, "constant B": const_b,
                "per-channel B": per_channel, "one side dynamic": one_side_dynamic, "short bias": short_bias,
                "an activation the epilogue lacks": sigmoid, "a residual": residual, "k past int32 sums": long_k,
                "an int32 B": int32_b, "a 16-bit output": wide_output}
    for name, layer in declined.items():
        assert not tactic.supports(layer), name


@needs_vnni
def test_k_may_vary_per_call_and_past_int32_sums_runs_torchs_formula(monkeypatch):
    """P.V of a dynamic sequence: k is the probabilities' last axis and V's rows, read per call. A k whose exact
    sums could pass int32 runs torch's formula (float32 sums: within a step of the exact one), and only that k."""
    view, _, _ = act_case("probabilities_by_values")
    view = LayerView(view.op_type, view.domain, view.attrs, view.input_shapes, view.input_dtypes, {},
                     view.output_dtypes, input_dynamic=((1, 2), (1,)))   # the sequence: m and k; n is static
    tactic = QActMatMulTactic()
    assert tactic.supports(view)
    formula_ks = []
    torchs = qgemm_act_c.lookup("QMatMul", "kiln")

    def spied(attrs, xs):
        formula_ks.append(xs[0].shape[-1])
        return torchs.impl(attrs, xs)
    monkeypatch.setattr(qgemm_act_c, "lookup", lambda op, domain: dataclasses.replace(torchs, impl=spied))
    run = tactic.prepare(view)
    g = torch.Generator().manual_seed(7)
    for seq in (5, 24, 61, MAX_K_ZERO_POINTS + 1):
        a, b = rand_q((3, min(seq, 8), seq), "uint8", g), rand_q((3, seq, 16), "uint8", g)
        a[..., 61:] = 0   # the zero point: a long row's tail adds nothing, so the outputs stay in range
        got, want = run([a, b])[0], act_formula(view, a, b)
        if seq <= MAX_K_ZERO_POINTS:
            assert torch.equal(got.float(), want.float()), seq
        else:
            assert (got.float() - want.float()).abs().max() <= 1 and torch.unique(want).numel() > 5
    assert formula_ks == [MAX_K_ZERO_POINTS + 1]


@needs_vnni
def test_a_product_rounded_before_its_bias_rounds_on_this_kernel_too():
    n = CASES["odd_shapes_s8_by_u8"][3]
    view, a, b = act_case("odd_shapes_s8_by_u8", bias=torch.linspace(-2, 2, n))
    q = {**view.attrs["quant"], "mid_dtype": "int8", "mid_zero_point": -2, "mid_scale": 0.07}
    view = LayerView(view.op_type, view.domain, {"quant": q}, view.input_shapes, view.input_dtypes,
                     view.const_inputs, view.output_dtypes)
    got = QActMatMulTactic().prepare(view)([a, b])[0]
    assert torch.equal(got.float(), act_formula(view, a, b))
    plain = act_case("odd_shapes_s8_by_u8", bias=view.const_inputs[2])[0]
    assert (got.float() != act_formula(plain, a, b).float()).float().mean() > 0.05   # the mid rounding matters


@needs_vnni
def test_a_b_that_does_not_follow_a_is_refused_not_read_past_its_end():
    view, a, b = act_case("odd_shapes_s8_by_u8")
    run = QActMatMulTactic().prepare(view)
    with pytest.raises(ValueError, match=r"B's shape \[1, 3, 37, 45\] does not follow A's \[2, 3, 13, 37\]"):
        run([a, b[:1].contiguous()])


def attention_model(seq=24, heads=2, head=16):
    """A Q/DQ attention core as quantize_static writes it: u8 Q, K^T, V with zero points; scores = DQ(Q) . DQ(K^T)
    -> Q/DQ -> Softmax -> Q/DQ (scale 1/255, zp 0) -> . DQ(V) -> Q/DQ, FP32 out."""
    h = helper.make_node
    params = {"q": (0.05, 127), "k": (0.06, 128), "v": (0.04, 126), "s": (0.1973, 120), "p": (1 / 255, 0),
              "o": (0.03, 125)}
    inits = []
    for name, (scale, zp) in params.items():
        inits += [numpy_helper.from_array(np.float32(scale), f"{name}_s"),
                  numpy_helper.from_array(np.uint8(zp), f"{name}_z")]

    def qdq(x, name, out):
        return [h("QuantizeLinear", [x, f"{name}_s", f"{name}_z"], [f"{out}_q"], name=f"{out}_Q"),
                h("DequantizeLinear", [f"{out}_q", f"{name}_s", f"{name}_z"], [out], name=f"{out}_DQ")]
    nodes = [*qdq("q", "q", "qf"), *qdq("kt", "k", "kf"), *qdq("v", "v", "vf"),
             h("MatMul", ["qf", "kf"], ["scores"], name="scores_mm"), *qdq("scores", "s", "sf"),
             h("Softmax", ["sf"], ["probs"], axis=-1, name="softmax"), *qdq("probs", "p", "pf"),
             h("MatMul", ["pf", "vf"], ["ctx"], name="context_mm"), *qdq("ctx", "o", "out")]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [1, heads, seq, head]),
              helper.make_tensor_value_info("kt", f, [1, heads, head, seq]),
              helper.make_tensor_value_info("v", f, [1, heads, seq, head])]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("out", f, [1, heads, seq, head])], inits)


@pytest.mark.parametrize("sources", ["-openvino,-onnxruntime", "torch"])
def test_quantized_attention_products_run_in_int8_matching_onnxruntime(sources):
    model = attention_model()
    engine = kiln.build(model, tactic_sources=sources, autotune=False)
    products = [l for l in engine.plan.layers if l.op_type == "QMatMul"]
    assert [l.name for l in products] == ["scores_mm + sf_Q", "context_mm + out_Q"]
    assert all(l.precision == "INT8" and l.inputs[1].dtype == "uint8" for l in products)
    own = sources != "torch" and vnni_available()
    assert {l.tactic_name for l in products} == {"kiln.qmatmul_act_int8" if own else "torch.reference"}
    assert not [l for l in engine.plan.layers if l.op_type == "MatMul"]   # no FP32 product left
    rng = np.random.default_rng(2)
    feeds = {"q": rng.normal(0, 2, (1, 2, 24, 16)), "kt": rng.normal(0, 2, (1, 2, 16, 24)),
             "v": rng.normal(0, 2, (1, 2, 24, 16))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    got, want = engine.run(feeds)["out"], unfused_onnxruntime(model, feeds)
    assert len(np.unique(want)) > 30
    # onnxruntime's float products round differently from exact integer sums: one output step (0.03), rarely
    diff = np.abs(got - want)
    assert diff.max() <= 0.03 + 1e-6 and (diff < 1e-6).mean() >= 0.97
