"""kiln's INT8 LayerNorm (QLayerNorm: DequantizeLinear -> LayerNormalization -> QuantizeLinear, the residual QAdd
optionally inside; kiln.tactics.layernorm_c) against the formula for each pair of INT8 types, odd and long rows and
two threads; a quantize_static encoder's residual + LayerNorm against onnxruntime's unfused ops; the layers it
declines."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.layernorm_c import QLAYERNORM_TACTIC, QuantizedLayerNormTactic
from tests.conftest import assert_int8_layer_matches_onnxruntime, make_model, torch_threads
from tests.tactics.amx import built_with, quantize_path  # noqa: F401  (fixtures)
from tests.tactics.test_qgemm_c import RANGES, TORCH, rand_q

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")

TACTIC = QuantizedLayerNormTactic()
MID = {"uint8": 128, "int8": 0}


def qlayernorm(shape, x_dtype, y_dtype, skip=None, dynamic=(), eps=1e-5, seed=0, bias=True):
    """A QLayerNorm view over the last axis: x at scale 0.07, y at 0.03 (zero points near the middle); with `skip`
    (a's and b's types) the residual sum's quantization at scales that produce ties (0.5, 0.25 -> 0.5), read
    back at x's (0.45, another zero point: each parameter in its own slot)."""
    n = shape[-1]
    gen = torch.Generator().manual_seed(seed)
    gamma, beta = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen) * 0.1
    quant = {"x_scale": 0.45 if skip else 0.07, "x_zero_point": MID[x_dtype] + 1, "x_dtype": x_dtype,
             "y_scale": 0.03, "y_zero_point": MID[y_dtype] - 5, "y_dtype": y_dtype}
    attrs = {"axis": -1, "epsilon": eps, "quant": quant}
    acts = 1
    if skip:
        a_dtype, b_dtype = skip
        attrs["skip_quant"] = {"a_scale": 0.5, "a_zero_point": MID[a_dtype], "b_scale": 0.25,
                               "b_zero_point": MID[b_dtype] + 1, "y_scale": 0.5, "y_zero_point": MID[x_dtype] + 3,
                               "a_dtype": a_dtype, "b_dtype": b_dtype, "y_dtype": x_dtype}
        acts = 2
    params = 2 if bias else 1
    dtypes = (skip or (x_dtype,)) + ("float32",) * params
    consts = {acts: gamma, **({acts + 1: beta} if bias else {})}
    return LayerView("QLayerNorm", "kiln", attrs, (tuple(shape),) * acts + ((n,),) * params, dtypes, consts,
                     (y_dtype,), 17, (dynamic,) * acts + ((),) * params)


def levels(x: torch.Tensor, scale: float, zp: int, dtype: str) -> torch.Tensor:
    """ONNX QuantizeLinear's integers (half to even, saturated) of float32 or float64 values."""
    lo, hi = RANGES[dtype]
    return (torch.round(x / scale) + zp).clamp(lo, hi)


def formula(xs: list[torch.Tensor], view: LayerView, round_the_sum: bool = True) -> torch.Tensor:
    """The residual sum in float32 as the graph's DequantizeLinear/Add/QuantizeLinear compute it, the LayerNorm in
    float64, the output quantized (half to even, saturated)."""
    q, skip = view.attrs["quant"], view.attrs.get("skip_quant")
    if skip:
        total = (xs[0].float() - skip["a_zero_point"]) * skip["a_scale"] + \
            (xs[1].float() - skip["b_zero_point"]) * skip["b_scale"]
        x = levels(total, skip["y_scale"], skip["y_zero_point"], skip["y_dtype"]) if round_the_sum else \
            total / q["x_scale"] + q["x_zero_point"]
    else:
        x = xs[0].double()
    acts = 2 if skip else 1
    v = (x.double() - q["x_zero_point"]) * q["x_scale"]
    mean, var = v.mean(-1, keepdim=True), v.var(-1, unbiased=False, keepdim=True)
    gamma = view.const_inputs[acts].double()
    beta = view.const_inputs[acts + 1].double() if acts + 1 in view.const_inputs else 0.0
    y = (v - mean) / torch.sqrt(var + view.attrs["epsilon"]) * gamma + beta
    return levels(y, q["y_scale"], q["y_zero_point"], q["y_dtype"]).to(torch.int32)


def random_codes(shape, dtype, seed):
    return rand_q(shape, dtype, torch.Generator().manual_seed(seed))


def run_with_threads(view, xs, threads):
    with torch_threads(threads):
        return TACTIC.prepare(view)(xs)[0]


def close(y: torch.Tensor, want: torch.Tensor) -> bool:
    """FP32 statistics against float64: a rare value a step off."""
    diff = (y.to(torch.int32) - want).abs()
    return diff.max() <= 1 and (diff == 0).double().mean() >= 0.999


@pytest.mark.parametrize("x_dtype,y_dtype", [("uint8", "uint8"), ("int8", "int8"), ("uint8", "int8"),
                                             ("int8", "uint8")])
@pytest.mark.parametrize("shape,threads", [((3, 5, 77), 1), ((2, 64, 768), 2), ((2, 20000), 2)])
def test_the_kernel_quantizes_the_layer_norm_of_the_dequantized_row(x_dtype, y_dtype, shape, threads,
                                                                  quantize_path):
    view = qlayernorm(shape, x_dtype, y_dtype)
    assert TACTIC.supports(view)
    x = random_codes(shape, x_dtype, 1)
    y = run_with_threads(view, [x], threads)
    want = formula([x], view)
    assert y.dtype == TORCH[y_dtype] and y.shape == x.shape and close(y, want)
    assert len(torch.unique(want)) > 50


@pytest.mark.parametrize("a_dtype,b_dtype,x_dtype,y_dtype", [("uint8", "uint8", "uint8", "uint8"),
                                                             ("int8", "uint8", "int8", "uint8"),
                                                             ("uint8", "int8", "uint8", "int8")])
@pytest.mark.parametrize("shape,threads,bias", [((3, 5, 77), 1, True), ((2, 64, 768), 2, True),
                                               ((2, 20000), 2, False)])
def test_the_residual_sum_is_rounded_to_int8_before_the_norm(a_dtype, b_dtype, x_dtype, y_dtype, shape, threads,
                                                             bias):
    """0.5 a + 0.25 b at scale 0.5: a quarter of the sums are ties, rounded half to even as QuantizeLinear does;
    normalizing the unrounded sum instead would miss the formula. Rows longer than the kernel's int32 blocks, and
    a LayerNorm without bias, too."""
    view = qlayernorm(shape, x_dtype, y_dtype, skip=(a_dtype, b_dtype), bias=bias)
    assert TACTIC.supports(view)
    xs = [random_codes(shape, a_dtype, 2), random_codes(shape, b_dtype, 3)]
    y = run_with_threads(view, xs, threads)
    assert y.dtype == TORCH[y_dtype] and close(y, formula(xs, view))
    assert not close(y, formula(xs, view, round_the_sum=False))


def residual_layer_norm_model(n=256):
    """a, b (u8) -> DQ, DQ -> Add -> Q -> DQ -> LayerNormalization -> Q (u8): a post-LN encoder's residual."""
    h = helper.make_node
    nodes = [h("DequantizeLinear", ["a", "a_s", "a_z"], ["af"]), h("DequantizeLinear", ["b", "b_s", "b_z"], ["bf"]),
             h("Add", ["af", "bf"], ["s"], name="add"), h("QuantizeLinear", ["s", "s_s", "s_z"], ["sq"], name="add_q"),
             h("DequantizeLinear", ["sq", "s_s", "s_z"], ["sf"]),
             h("LayerNormalization", ["sf", "gamma", "beta"], ["n"], name="ln", axis=-1, epsilon=1e-12),
             h("QuantizeLinear", ["n", "y_s", "y_z"], ["y"], name="ln_q")]
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(np.float32(v), k) for k, v in
             (("a_s", 0.043), ("b_s", 0.061), ("s_s", 0.072), ("y_s", 0.047))] + \
            [numpy_helper.from_array(np.uint8(v), k) for k, v in (("a_z", 131), ("b_z", 120), ("s_z", 127),
                                                                  ("y_z", 125))] + \
            [numpy_helper.from_array((rng.random(n) + 0.5).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), "beta")]
    ins = [helper.make_tensor_value_info(k, TensorProto.UINT8, [1, 128, n]) for k in "ab"]
    return make_model(nodes, ins, [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 128, n])], inits)


def test_an_int8_residual_layer_norm_is_one_layer_matching_onnxruntime():
    rng = np.random.default_rng(5)
    feeds = {k: rng.integers(0, 256, (1, 128, 256)).astype(np.uint8) for k in "ab"}
    assert_int8_layer_matches_onnxruntime(residual_layer_norm_model(), feeds,
                                          ("add + add_q + ln + ln_q", "QLayerNorm", QLAYERNORM_TACTIC), np.uint8,
                                          exact=0.999, spread=50)


def test_layers_it_declines():
    """A normalized axis that varies per call (the scale's length is fixed), or FP32 activations."""
    assert not TACTIC.supports(qlayernorm((2, 16), "uint8", "uint8", dynamic=(1,)))
    assert TACTIC.supports(qlayernorm((2, 16), "uint8", "uint8", dynamic=(0,)))
    view = qlayernorm((2, 16), "uint8", "uint8")
    float_input = LayerView(view.op_type, view.domain, view.attrs, view.input_shapes,
                            ("float32",) + view.input_dtypes[1:], view.const_inputs, view.output_dtypes, 17,
                            view.input_dynamic)
    assert not TACTIC.supports(float_input)


def test_a_residual_that_broadcasts_at_run_time_is_computed_not_read_past_its_end():
    """The kernel reads one row of b per row of a; a b of another shape (a batch axis both vary in, 1 in b) runs
    torch's formula instead, broadcasting as the QAdd would."""
    view = qlayernorm((2, 16), "uint8", "uint8", skip=("uint8", "uint8"), dynamic=(0,))
    assert TACTIC.supports(view)
    a, b = random_codes((3, 16), "uint8", 6), random_codes((1, 16), "uint8", 7)
    y = TACTIC.prepare(view)([a, b])[0]
    assert y.shape == (3, 16) and close(y, formula([a, b], view))


def test_a_quantize_static_pre_ln_encoder_runs_its_norms_and_products_in_int8(tmp_path, monkeypatch):
    """torch's nn.TransformerEncoder (norm_first: each LayerNorm reads the residual stream, which the next sum
    reads too) clones its layer, so the export shares weights through Identity nodes, which quantize_static wraps
    in Q(DQ(w)). Every LayerNorm is a QLayerNorm; every product INT8; close to onnxruntime."""
    import warnings

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from tests.conftest import cosine, force_plan, run_ort

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.LayerNorm(32)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 16, 32),), tmp_path / "pre.onnx", input_names=["x"],
                          output_names=["y"], opset_version=17, dynamo=False)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((1, 16, 32)).astype(np.float32)} for _ in range(3)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(batches[:2])

        def get_next(self):
            return next(self.feeds, None)
    quantize_static(str(tmp_path / "pre.onnx"), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    force_plan(monkeypatch, "kiln")
    engine = kiln.build(str(tmp_path / "q.onnx"), autotune=False)
    layers = engine.plan.layers
    norms = [(l.op_type, l.tactic_name, "skip_quant" in l.attrs) for l in layers if "Norm" in l.op_type]
    # two per layer read the residual stream; the final one takes the last sum, which nothing else reads
    assert norms == [("QLayerNorm", QLAYERNORM_TACTIC, False)] * 4 + [("QLayerNorm", QLAYERNORM_TACTIC, True)]
    assert not {"MatMul", "Gemm", "LayerNormalization"} & {l.op_type for l in layers}
    assert sum(l.op_type in ("QMatMul", "QGemm") for l in layers) == 12   # 4 by weights, 2 of activations a layer
    got, want = engine.run(batches[2])["y"], run_ort(str(tmp_path / "q.onnx"), batches[2])[0]
    assert cosine(got, want) >= 0.999
