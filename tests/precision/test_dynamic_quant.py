"""Dynamically quantized models (onnxruntime's quantize_dynamic: DynamicQuantizeLinear -> MatMulInteger -> Cast ->
Mul, the usual INT8 recipe for transformers) run each product as one INT8 layer on kiln's own kernel, bit for bit
as onnxruntime runs them; before, the five ops ran one by one, the product on the reference kernel."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics.qgemm_c import vnni_available
from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.tactics.amx import amx_int8_kernels, built_with, emulated_amx_libraries, quantize_path  # noqa: F401

KILN_ONLY = "-openvino,-onnxruntime"
KERNELS = {"kiln.dynamic_qmatmul_gemm_int8", "kiln.dynamic_qmatmul_gemm_amx_int8"}   # on AMX-INT8 CPUs the two race
needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no AVX512-VNNI here: DynamicQMatMul runs on the "
                                "reference kernel")


def quantize_dynamic(model: onnx.ModelProto | str, path, **options) -> str:
    from onnxruntime.quantization import QuantType, quantize_dynamic as ort_quantize

    source = model if isinstance(model, str) else str(path) + ".fp32.onnx"
    if not isinstance(model, str):
        onnx.save(model, source)
    ort_quantize(source, str(path), weight_type=options.pop("weight_type", QuantType.QInt8), **options)
    return str(path)


def two_linears(k: int = 75, hidden: int = 50, n: int = 37) -> onnx.ModelProto:
    """x [2, 7, k] -> MatMul + bias -> Relu -> MatMul + bias: sizes off every kernel's blocking."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "w1"], ["m1"], name="fc1"), h("Add", ["m1", "b1"], ["a1"], name="fc1_bias"),
             h("Relu", ["a1"], ["r"], name="relu"), h("MatMul", ["r", "w2"], ["m2"], name="fc2"),
             h("Add", ["m2", "b2"], ["y"], name="fc2_bias")]
    inits = [init("w1", rand((k, hidden), 1) * 0.2), init("b1", rand((hidden,), 2)),
             init("w2", rand((hidden, n), 3) * 0.2), init("b2", rand((n,), 4))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, k])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, n])], inits)


@pytest.mark.parametrize("sources", [pytest.param("kiln", marks=needs_vnni), "torch", "onnxruntime"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_each_product_is_one_int8_layer_equal_to_onnxruntime_bit_for_bit(tmp_path, monkeypatch, sources, per_channel):
    from tests.conftest import force_plan

    if sources == "onnxruntime":   # the whole-graph region, not its layers one by one, whichever times faster here
        force_plan(monkeypatch, "onnxruntime")
    path = quantize_dynamic(two_linears(), tmp_path / "q.onnx", per_channel=per_channel)
    assert Counter(n.op_type for n in onnx.load(path).graph.node)["MatMulInteger"] == 2
    engine = kiln.build(path, tactic_sources=sources)
    x = {"x": (rand((2, 7, 75), 5) * 3 + 0.7).astype(np.float32)}
    np.testing.assert_array_equal(engine.run(x)["y"], run_ort(path, x)[0])
    if sources == "onnxruntime":   # the region gets quantize_dynamic's ops back, which onnxruntime fuses again
        assert [l.op_type for l in engine.plan.layers] == ["Region"]
        return
    products = [l for l in engine.plan.layers if l.op_type == "DynamicQMatMul"]
    # named after every ONNX node it computes, quantize_dynamic's and the model's
    assert [l.name for l in products] == [
        "fc1_quant + m1_output_quantized_cast + fc1_quant_output_scale_mul + fc1_quant_scales_mul + x_QuantizeLinear"
        " + fc1_bias + relu",
        "fc2_quant + m2_output_quantized_cast + fc2_quant_output_scale_mul + fc2_quant_scales_mul + r_QuantizeLinear"
        " + fc2_bias"]
    assert all(l.precision == "INT8" and l.tactic_name in (KERNELS if sources == "kiln" else {"torch.reference"})
               for l in products)
    assert len(engine.plan.layers) == 2   # the ReLU between them in the first one's epilogue


@pytest.mark.parametrize("symmetric", [False, True])
def test_unsigned_weights_run_exactly_on_kilns_kernel(tmp_path, symmetric):
    """u8 weights run on kiln's kernel read as s8 (W - 128, the zero point shifted with them): symmetric ones (zero
    point 128: optimum's AVX2 recipe) need no correction after that; quantize_dynamic's asymmetric ones keep a zero
    point, and each row's byte sum times it is taken off. Both exact."""
    from onnxruntime.quantization import QuantType

    path = quantize_dynamic(two_linears(), tmp_path / "q.onnx", weight_type=QuantType.QUInt8,
                            extra_options={"WeightSymmetric": symmetric})
    zero_points = {t.name: numpy_helper.to_array(t).item() for t in onnx.load(path).graph.initializer
                   if t.name.endswith("zero_point")}
    assert zero_points == ({"w1_zero_point": 128, "w2_zero_point": 128} if symmetric else
                           {"w1_zero_point": 124, "w2_zero_point": 128})   # fc1's W - 124 reaches 131
    engine = kiln.build(path, tactic_sources="kiln", autotune=False)   # the first tactic that takes it
    products = [l for l in engine.plan.layers if l.op_type == "DynamicQMatMul"]
    assert [l.tactic_name in KERNELS if vnni_available() else l.tactic_name == "torch.reference"
            for l in products] == [True, True]
    x = {"x": rand((2, 7, 75), 6)}
    np.testing.assert_array_equal(engine.run(x)["y"], run_ort(path, x)[0])


def layer(rows: int, k: int = 70, n: int = 45, seed: int = 8):
    """A DynamicQMatMul's LayerView and its operands [x, W, bias]: s8 weights, per-column scales, a bias."""
    import torch

    from kiln.tactics.base import LayerView

    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.integers(-127, 128, (k, n)).astype(np.int8))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    quant = {"x_dtype": "uint8", "w_axis": 1, "w_scale": (rng.random(n) * 0.01 + 1e-3).tolist(),
             "w_zero_point": [0] * n}
    view = LayerView("DynamicQMatMul", "kiln", {"quant": quant}, ((rows, k), (k, n), (n,)),
                     ("float32", "int8", "float32"), {1: w, 2: bias})
    return view, [x, w, bias]


def onnxruntime_chain(view, x) -> np.ndarray:
    """onnxruntime running the layer as quantize_dynamic writes it: DynamicQuantizeLinear -> MatMulInteger -> Cast ->
    Mul(x_scale * W_scale) -> Add(bias)."""
    h = helper.make_node
    w, bias = view.const_inputs[1].numpy(), view.const_inputs[2].numpy()
    nodes = [h("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]), h("MatMulInteger", ["xq", "w", "xz"], ["i"]),
             h("Cast", ["i"], ["f"], to=TensorProto.FLOAT), h("Mul", ["xs", "ws"], ["s"]),
             h("Mul", ["f", "s"], ["m"]), h("Add", ["m", "b"], ["y"])]
    inits = [init("w", w), init("ws", np.asarray(view.attrs["quant"]["w_scale"], np.float32)), init("b", bias)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[0], w.shape[1]])], inits)
    return run_ort(model, {"x": np.asarray(x)})[0]


@needs_vnni
@pytest.mark.parametrize("case", ["zeros", "negative", "one_row", "nan", "wide", "boundaries"])
def test_the_kernel_equals_onnxruntime_at_the_edges_of_the_range(case, quantize_path):
    """An all-zero input (scale 1), an all-negative one (zero point 255), a single row, a NaN, which neither
    breaks the scale nor touches other rows (onnxruntime, given 0 in its place, gives the other rows exactly: the
    range always holds 0), 21,000 values, and values on and next to the rounding boundaries (n + 1/2) * scale:
    with the input quantized by division and by the corrected reciprocal (tests/tactics/amx.py's quantize_path)."""
    from kiln.tactics.dqgemm_c import DynamicQLinearGemmTactic

    view, (x, w, bias) = layer({"one_row": 1, "wide": 300, "boundaries": 30}.get(case, 5))
    x = {"zeros": x * 0, "negative": -x.abs() - 0.1, "boundaries": boundary_values(x.shape)}.get(case, x)
    if case == "nan":
        x[2, 3] = 0.0
    want = onnxruntime_chain(view, x)
    if case == "nan":
        x[2, 3] = float("nan")
    got = DynamicQLinearGemmTactic().prepare(view)([x, w, bias])[0].numpy()
    rows = [0, 1, 3, 4] if case == "nan" else slice(None)   # the NaN's row: its sum is undefined
    np.testing.assert_array_equal(got[rows], want[rows])


def boundary_values(shape):
    """A [rows, k] input ranging over [-1.3, 2.1] (scale (2.1 + 1.3) / 255) whose other values are the float32
    nearest (n + 1/2) * scale and its neighbours one and two ulps either side: where x * (1 / scale) and x / scale
    round to different integers."""
    import torch

    scale = (np.float32(2.1) - np.float32(-1.3)) / np.float32(255)
    n = np.arange(-97, 157, dtype=np.float32)
    centre = ((n + np.float32(0.5)) * scale).astype(np.float32)
    spread = [centre]
    up, down = centre, centre
    for _ in range(2):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        spread += [up, down]
    flat = np.resize(np.concatenate(spread), shape[0] * shape[1]).astype(np.float32)
    flat[0], flat[1] = np.float32(-1.3), np.float32(2.1)
    return torch.from_numpy(flat.reshape(shape))


@needs_vnni
@pytest.mark.parametrize("act", [{"op": "Gelu", "attrs": {}}, {"op": "Gelu", "attrs": {"approximate": "tanh"}},
                                 {"op": "LeakyRelu", "attrs": {"alpha": 0.1}}])
def test_the_kernel_applies_the_fused_activation(act):
    """GELU (both forms) in the INT8 epilogue, to a float ulp or so of the exact function (a rational
    approximation of erf and tanh, as MLAS uses); an activation the epilogue lacks runs after the kernel, exactly."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from kiln.tactics.dqgemm_c import DynamicQLinearGemmTactic

    view, (x, w, bias) = layer(13, k=150, n=70)
    view = dataclasses.replace(view, attrs={**view.attrs, "activation": act})
    got = DynamicQLinearGemmTactic().prepare(view)([x, w, bias])[0]
    sums = torch.from_numpy(onnxruntime_chain(view, x)).double()
    if act["op"] == "LeakyRelu":
        np.testing.assert_array_equal(got.numpy(), F.leaky_relu(sums.float(), 0.1).numpy())
    else:
        want = F.gelu(sums, approximate=act["attrs"].get("approximate", "none"))
        # 0.5 x (1 + tanh(...)) cancels where tanh is near -1: its error there grows with |x|
        error, bound = (got.double() - want).abs(), 2e-6 * want.abs() + 2e-6 + 2e-7 * sums.abs()
        assert (error <= bound).all(), float((error - bound).max())
        assert (got < 0).any() and (got > 1).any()   # both sides of the curve were exercised


@needs_vnni
def test_the_amx_variant_equals_onnxruntime(amx_int8_kernels):
    """On AMX-INT8 tiles (emulated in C where this CPU has none): the same sums, so onnxruntime's floats."""
    from kiln.tactics.dqgemm_c import DynamicQLinearGemmAmxTactic

    view, xs = layer(45, k=150, n=70)
    amx = DynamicQLinearGemmAmxTactic()
    assert amx.supports(view)
    np.testing.assert_array_equal(amx.prepare(view)(xs)[0].numpy(), onnxruntime_chain(view, xs[0]))


def test_the_quantization_parameters_are_onnxruntimes_leave_nan_out_and_keep_inf():
    import torch

    from kiln.ops.quantize import dynamic_qparams

    x = rand((4, 33), 9) * 2.5
    feeds = {"x": x}
    model = make_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 33])],
                       [helper.make_tensor_value_info(n, t, None) for n, t in
                        (("q", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8))])
    _, scale, zero = run_ort(model, feeds)
    assert dynamic_qparams(torch.from_numpy(x)) == (scale, zero)
    with_nan, with_zero = torch.from_numpy(x).clone(), x.copy()
    with_nan[1, 2], with_zero[1, 2] = float("nan"), 0.0   # left out = 0 in its place: the range always holds 0
    assert dynamic_qparams(with_nan) == tuple(run_ort(model, {"x": with_zero})[1:])
    with_inf = x.copy()
    with_inf[1, 2] = float("inf")   # an infinite range, as onnxruntime computes it
    assert dynamic_qparams(torch.from_numpy(with_inf)) == tuple(run_ort(model, {"x": with_inf})[1:])
    assert dynamic_qparams(torch.zeros(3)) == (np.float32(1), 0)


def test_a_dynamically_quantized_bert_runs_its_products_in_int8_on_kilns_kernels(tmp_path):
    from tests.models import encoders

    model = encoders.make_bert(layers=2, hidden=64, heads=4, intermediate=128)
    feeds = encoders.inputs(model, batch=2, seq=16)
    fp32 = encoders.fold_weight_transposes(encoders.export(model, feeds, tmp_path / "bert.onnx", "legacy"))
    path = quantize_dynamic(fp32, tmp_path / "bert_int8.onnx")
    engine = kiln.build(path, tactic_sources=KILN_ONLY, autotune=False)   # the first tactic that takes each layer
    ops = Counter(l.op_type for l in engine.plan.layers)
    # per layer: Q || K || V merged, the output projection, the two FFN products; and the pooler
    assert (ops["DynamicQMatMul"], ops["Attention"]) == (2 * 4 + 1, 2)
    assert not {"MatMulInteger", "DynamicQuantizeLinear", "MatMul"} & set(ops)
    merged = [l for l in engine.plan.layers if " || " in l.name]
    assert len(merged) == 2 and all(l.op_type == "DynamicQMatMul" and l.precision == "INT8" for l in merged)
    if vnni_available():
        assert {l.tactic_name for l in engine.plan.layers if l.op_type == "DynamicQMatMul"} <= KERNELS
    got = engine.run(feeds)
    want = run_ort(path, feeds)
    for name, expected in zip(engine.output_names, want):
        assert cosine(got[name], expected) > 0.9995, name   # float rounding may move a u8 step here and there
    assert cosine(got["last_hidden_state"], run_ort(fp32, feeds)[0]) > 0.99   # and the FP32 model's


def test_onnxruntimes_bert_recipe_optimize_then_quantize_runs_qattention_in_int8(tmp_path):
    """onnxruntime's BERT INT8 recipe: the transformers optimizer (Attention, SkipLayerNormalization, BiasGelu),
    then quantize_dynamic, which writes QAttention. Its projection unfolds into the dynamic-quantization chain,
    so it too is one INT8 product, and the attention one Attention layer."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    from tests.models import encoders

    model = encoders.make_bert(layers=2, hidden=64, heads=4, intermediate=128)
    feeds = encoders.inputs(model, batch=2, seq=16)
    encoders.export(model, feeds, tmp_path / "bert.onnx", "legacy")
    options = FusionOptions("bert")
    options.use_raw_attention_mask(True)
    optimizer.optimize_model(str(tmp_path / "bert.onnx"), model_type="bert", num_heads=4, hidden_size=64,
                             optimization_options=options, opt_level=0).save_model_to_file(str(tmp_path / "opt.onnx"))
    path = quantize_dynamic(str(tmp_path / "opt.onnx"), tmp_path / "bert_int8.onnx",
                            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    assert Counter(n.op_type for n in onnx.load(path).graph.node)["QAttention"] == 2
    engine = kiln.build(path, tactic_sources=KILN_ONLY)
    ops = Counter(l.op_type for l in engine.plan.layers)
    assert (ops["DynamicQMatMul"], ops["Attention"]) == (2 * 4 + 1, 2)
    qkv = [l for l in engine.plan.layers if l.op_type == "DynamicQMatMul" and "Attention_0_quant" in l.name]
    assert len(qkv) == 1 and qkv[0].precision == "INT8"
    got = engine.run(feeds)
    for name, expected in zip(engine.output_names, run_ort(path, feeds)):
        assert cosine(got[name], expected) > 0.9995, name


def test_lint_does_not_call_dynamic_quantization_the_int8_float_output_trap(tmp_path):
    """A dynamically quantized product reads and writes FP32 by design (the next one quantizes afresh): not the
    classic INT8 layer that lost its output scale, which kiln lint still reports (tests/precision/test_qdq.py)."""
    import json
    import subprocess
    import sys

    engine = kiln.build(quantize_dynamic(two_linears(), tmp_path / "q.onnx"), autotune=False)
    assert [l.precision for l in engine.plan.layers if l.op_type == "DynamicQMatMul"] == ["INT8", "INT8"]
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(engine.layer_info()))
    lint = subprocess.run([sys.executable, "-m", "kiln.cli.main", "lint", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0 and "INT8_FLOAT_OUTPUT" not in lint.stdout + lint.stderr
