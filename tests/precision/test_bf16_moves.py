"""BF16 through data-movement layers (kiln.tactics.reference.Bf16ReferenceTactic, and for Split, Slice and Concat
also kiln.tactics.copy_c's C copy, which the autotuner races against it): a YOLO C2f-shaped block whose
Split, Slice and Concat are granted BF16 and keep the tensors between BF16 convolutions in bf16; the kernel's
conversions where an input is stored otherwise than its output; where it is offered; engines loaded elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA
from kiln.tactics.reference import Bf16ReferenceTactic
from tests.conftest import cosine, init, make_model, rand, run_ort

needs_bf16 = pytest.mark.skipif(not (hardware.has_any(BF16_DOT_ISA) and native.available()),
                                reason="this CPU has no AVX512-BF16 (vdpbf16ps) or there is no C compiler: kiln's "
                                "BF16 kernels, which read and write bf16 tensors, are not offered here")
KILN_ONLY = "-openvino,-onnxruntime,-torch-onednn,-onednn"
MOVES = {"torch.reference_bf16", "kiln.copy_rows_bf16"}   # BF16 data movement: torch's, or kiln's C copy


def c2f_block() -> bytes:
    """x -> 1x1 conv + ReLU -> a; Split(a) -> s0, s1; Slice(a, channels 8:24) -> m; 3x3 conv(s1) -> b;
    Concat(s0, s1, m, b) -> cat; 1x1 conv(cat) -> y. A second output reads the 1x1 conv's input so x stays FP32."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a0"], name="cv1"),
             helper.make_node("Relu", ["a0"], ["a"], name="act1"),
             helper.make_node("Split", ["a", "halves"], ["s0", "s1"], name="split", axis=1),
             helper.make_node("Slice", ["a", "starts", "ends", "axes"], ["m"], name="middle"),
             helper.make_node("Conv", ["s1", "w2", "b2"], ["b"], name="m0", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["s0", "s1", "m", "b"], ["cat"], name="concat", axis=1),
             helper.make_node("Conv", ["cat", "w3", "b3"], ["y"], name="cv2")]
    inits = [init("w1", rand((32, 16, 1, 1), seed=1) * 0.25), init("b1", rand((32,), seed=2) * 0.1),
             init("w2", rand((16, 16, 3, 3), seed=3) * 0.08), init("b2", rand((16,), seed=4) * 0.1),
             init("w3", rand((24, 64, 1, 1), seed=5) * 0.12), init("b3", rand((24,), seed=6) * 0.1),
             init("halves", np.array([16, 16], np.int64)), init("starts", np.array([8], np.int64)),
             init("ends", np.array([24], np.int64)), init("axes", np.array([1], np.int64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 10, 10])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def channel_major_build(model, **options):
    """The block on kiln's channel-major kernels: the NCHW planes kernel, which cv2 (24 outputs) could also take
    after a Reformat of `cat` into row-major order, is left out, so timing cannot move `cat` to FP32."""
    from kiln.tactics.conv_planes import Conv1x1PlanesTactic

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Conv1x1PlanesTactic, "supports", lambda self, layer: False)
        return kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off",
                          **options)


@pytest.fixture(scope="module")
def block():
    model = c2f_block()
    return model, channel_major_build(model)


@needs_bf16
def test_split_slice_and_concat_between_bf16_convolutions_move_bf16(block):
    model, engine = block
    info = {layer["Name"]: layer for layer in engine.layer_info()["Layers"]}
    moves = {name: layer for name, layer in info.items() if layer["TacticName"] in MOVES}
    assert set(moves) == {"split", "middle", "concat"}
    for layer in moves.values():
        assert (layer["RequestedPrecision"], layer["GrantedPrecision"]) == ("BF16", "BF16")
        assert "PrecisionReason" not in layer
        formats = [t["Format/Datatype"] for t in (*layer["Inputs"], *layer["Outputs"])]
        assert formats and all(f.endswith("BF16 format") for f in formats), formats
    stored = {t.name: t.dtype for layer in engine.plan.layers for t in (*layer.inputs, *layer.outputs)}
    assert {name for name, dtype in stored.items() if dtype == "bfloat16"} == {"a", "s0", "s1", "m", "b", "cat"}
    x = rand((1, 16, 10, 10), seed=7)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999


@needs_bf16
def test_a_concat_of_an_fp32_layer_and_bf16_layers_converts_as_it_copies():
    """m0 pinned to FP32 reads s1 and writes b in FP32; the Concat rounds them into its bf16 output, which cv2
    reads (s0 and m, read by BF16 kernels only, stay bf16)."""
    model = c2f_block()
    engine = channel_major_build(model, layer_precisions="m0:fp32")
    layers = {layer.name: layer for layer in engine.plan.layers}
    concat = layers["concat"]
    assert concat.tactic_name in MOVES and concat.outputs[0].dtype == "bfloat16"
    assert [t.dtype for t in concat.inputs] == ["bfloat16", "float32", "bfloat16", "float32"]
    x = rand((1, 16, 10, 10), seed=8)
    assert cosine(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]) > 0.9999


@needs_bf16
def test_a_concat_of_a_constant_and_a_bf16_layer():
    """ViT's class token: Concat(constant [1,1,C], bf16 patch tokens) between BF16 MatMuls. The constant reaches
    the kernel as a weight, not a runtime tensor (this build failed on HF ViT with an AttributeError)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["tokens"], name="embed"),
             helper.make_node("Concat", ["cls", "tokens"], ["seq"], name="concat", axis=1),
             helper.make_node("MatMul", ["seq", "w2"], ["y"], name="head")]
    inits = [init("w1", rand((24, 32), seed=1) * 0.2), init("w2", rand((32, 16), seed=2) * 0.2),
             init("cls", rand((1, 1, 32), seed=3))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 9, 24])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off")
    concat = {layer.name: layer for layer in engine.plan.layers}["concat"]
    assert concat.tactic_name in MOVES and concat.precision == "BF16"
    x = rand((1, 9, 24), seed=4)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.shape == (1, 10, 16) and cosine(got, want) > 0.9999


def _view(op, in_shapes, in_dtypes, out_dtypes, attrs=None, consts=None):
    return LayerView(op, "", attrs or {}, tuple(in_shapes), tuple(in_dtypes), consts or {}, tuple(out_dtypes), 17,
                     tuple(() for _ in in_shapes))


@needs_bf16
def test_the_kernel_writes_each_output_as_the_plan_stores_it():
    tactic = Bf16ReferenceTactic()
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    concat = tactic.prepare(_view("Concat", [(2, 3, 4), (2, 5, 4)], ["float32", "bfloat16"], ["bfloat16"],
                                  {"axis": 1}))
    y = concat([a, b.bfloat16()])[0]
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.cat([a, b], 1).bfloat16())
    widened = tactic.prepare(_view("Concat", [(2, 3, 4), (2, 5, 4)], ["bfloat16", "bfloat16"], ["float32"],
                                   {"axis": 1}))([a.bfloat16(), b.bfloat16()])[0]
    assert widened.dtype == torch.float32 and torch.equal(widened, torch.cat([a, b], 1).bfloat16().float())
    split = tactic.prepare(_view("Split", [(2, 8, 4), (2,)], ["bfloat16", "int64"], ["bfloat16", "float32"],
                                 {"axis": 1}, {1: torch.tensor([3, 5])}))
    x = torch.randn(2, 8, 4).bfloat16()
    first, second = split([x, None])
    assert (first.dtype, second.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(first, x[:, :3]) and torch.equal(second, x[:, 3:].float())


def test_it_is_offered_for_float_data_movement_on_bf16_cpus_only(monkeypatch):
    tactic = Bf16ReferenceTactic()
    floats = _view("Concat", [(2, 3), (2, 3)], ["float32", "float32"], ["float32"], {"axis": 0})
    shapes = _view("Concat", [(2,), (2,)], ["int64", "int64"], ["int64"], {"axis": 0})
    relu = _view("Relu", [(2, 3)], ["float32"], ["float32"])
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert tactic.supports(floats) and not tactic.supports(shapes) and not tactic.supports(relu)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2"}))
    assert not tactic.supports(floats)   # no native BF16: --bf16 is denied with that reason, not granted here


@needs_bf16
def test_an_engine_with_bf16_moves_runs_unchanged_on_a_cpu_without_bf16(block, tmp_path, monkeypatch, caplog):
    model, engine = block
    path = tmp_path / "block.kiln"
    engine.save(path)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    loaded = kiln.load(path, allow_other_device=True)   # the BF16 convolutions fall back to torch's, in FP32
    assert not [r for r in caplog.records if any(m in r.getMessage() for m in MOVES)]   # they need no ISA of their own
    x = rand((1, 16, 10, 10), seed=9)
    assert cosine(loaded.run({"x": x})["y"], run_ort(model, {"x": x})[0]) > 0.9999


@needs_bf16
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_a_pad_between_bf16_convolutions_moves_bf16(mode):
    """A reflection-padded convolution (style transfer, super-resolution) and a Pad of a non-zero constant (a zero
    one folds into the convolution): the Pad between two BF16 layers is granted BF16 and pads the bf16 tensor, with
    no Reformat on either side."""
    pad_inputs = ["a", "pads"] + (["half"] if mode == "constant" else [])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="cv1"),
             helper.make_node("Pad", pad_inputs, ["p"], name="pad", mode=mode),
             helper.make_node("Conv", ["p", "w2", "b2"], ["y"], name="cv2")]
    inits = [init("w1", rand((16, 8, 1, 1), seed=1) * 0.3), init("b1", rand((16,), seed=2) * 0.1),
             init("w2", rand((8, 16, 3, 3), seed=3) * 0.1), init("b2", rand((8,), seed=4) * 0.1),
             init("pads", np.array([0, 0, 1, 2, 0, 0, 1, 0], np.int64)), init("half", np.array(0.5, np.float32))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off")
    layers = {layer.name: layer for layer in engine.plan.layers}
    assert layers["pad"].tactic_name in MOVES and layers["pad"].precision == "BF16"
    assert not [name for name in layers if name.startswith("Reformatting") and "pad" in name]
    x = rand((1, 8, 9, 9), seed=5)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.shape == (1, 8, 9, 9) and cosine(got, want) > 0.9999


@needs_bf16
def test_picks_are_exact_and_sums_are_fp32_on_bf16_storage():
    """Gather and ReduceMax only pick stored values: exactly the picks of the bf16 tensor. ReduceSum widens its
    bf16 input and sums in FP32, one rounding at the end: 4096 values of 1 + 2^-7 sum to 4128 exactly, where a
    bf16 running sum would stall at 256."""
    tactic = Bf16ReferenceTactic()
    x = torch.randn(2, 6, 5).bfloat16()
    gather = tactic.prepare(_view("Gather", [(2, 6, 5), ()], ["bfloat16", "int64"], ["bfloat16"], {"axis": 1},
                                  {1: torch.tensor(0)}))
    picked = gather([x, None])[0]
    assert picked.dtype == torch.bfloat16 and torch.equal(picked, x[:, 0])
    biggest = tactic.prepare(_view("ReduceMax", [(2, 6, 5)], ["bfloat16"], ["float32"], {"axes": [1]}))([x])[0]
    assert biggest.dtype == torch.float32 and torch.equal(biggest, x.float().amax(1, keepdim=True))
    ones = torch.full((1, 4096), 1 + 2 ** -7).bfloat16()
    total = tactic.prepare(_view("ReduceSum", [(1, 4096), (1,)], ["bfloat16", "int64"], ["bfloat16"], {},
                                 {1: torch.tensor([1])}))([ones, None])[0]
    assert total.dtype == torch.bfloat16 and total.item() == 4128.0


@needs_bf16
def test_a_class_token_gather_and_a_pooling_sum_between_bf16_matrix_products_are_bf16():
    """ViT's head reads token 0 (Gather), a sentence encoder sums over tokens (ReduceSum): both are granted BF16
    between BF16 MatMuls and keep the tensors bf16, where they stayed FP32 for want of a kernel before."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "w1"], ["a"], name="proj"), h("Gather", ["a", "zero"], ["cls"], name="cls", axis=1),
             h("ReduceSum", ["a", "one"], ["pooled"], name="pool", keepdims=0),
             h("Add", ["cls", "pooled"], ["s"], name="merge"), h("MatMul", ["s", "w2"], ["y"], name="head")]
    inits = [init("w1", rand((32, 64), seed=1) * 0.2), init("w2", rand((64, 16), seed=2) * 0.1),
             init("zero", np.array(0, np.int64)), init("one", np.array([1], np.int64))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12, 32])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=13)
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off")
    layers = {layer.name: layer for layer in engine.plan.layers}
    assert (layers["cls"].precision, layers["pool"].precision) == ("BF16", "BF16")
    assert {layers["cls"].tactic_name, layers["pool"].tactic_name} == {"torch.reference_bf16"}
    stored = {t.name: t.dtype for layer in engine.plan.layers for t in (*layer.inputs, *layer.outputs)}
    assert (stored["a"], stored["cls"], stored["pooled"]) == ("bfloat16",) * 3
    x = rand((2, 12, 32), seed=3)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.shape == (2, 16) and cosine(got, want) > 0.9999


@needs_bf16
def test_topk_and_argmax_pick_bf16_values_and_return_int64_indices():
    """TopK and ArgMax between BF16 layers read the bf16 tensor as stored (no Reformat): TopK's values stay bf16
    for the next MatMul, its indices and ArgMax's are int64; ties among values equal once rounded go to the lowest
    index, as ONNX asks. Every picked index holds one of the k largest FP32 values to within bf16 rounding."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "w1"], ["a"], name="proj"), h("TopK", ["a", "k"], ["top", "idx"], name="topk"),
             h("MatMul", ["top", "w2"], ["y"], name="head"), h("ArgMax", ["a"], ["best"], name="argmax", axis=-1)]
    inits = [init("w1", rand((32, 64), seed=1) * 0.2), init("w2", rand((8, 16), seed=2) * 0.1),
             init("k", np.array([8], np.int64))]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("idx", TensorProto.INT64, None),
               helper.make_tensor_value_info("best", TensorProto.INT64, None)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])], outputs, inits)
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY, precision_constraints="prefer", accuracy="off")
    layers = {layer.name: layer for layer in engine.plan.layers}
    for name in ("topk", "argmax"):
        assert (layers[name].precision, layers[name].tactic_name) == ("BF16", "torch.reference_bf16")
    stored = {t.name: t.dtype for layer in engine.plan.layers for t in (*layer.inputs, *layer.outputs)}
    assert (stored["a"], stored["top"], stored["idx"], stored["best"]) == ("bfloat16", "bfloat16", "int64", "int64")
    x = rand((4, 32), seed=3)
    got = engine.run({"x": x})
    a = x @ rand((32, 64), seed=1) * 0.2
    kth = np.sort(a, axis=-1)[:, -8:-7]
    assert got["idx"].dtype == np.int64 and (np.take_along_axis(a, got["idx"], -1) >= kth - np.abs(kth) / 64).all()
    assert np.allclose(np.take_along_axis(a, got["best"], -1)[:, 0], a.max(-1), rtol=1 / 64)   # keepdims: [4, 1]
    assert cosine(got["y"], run_ort(model, {"x": x})[0]) > 0.999


@needs_bf16
def test_the_build_log_counts_bf16_storage_once_for_the_plan_built(caplog):
    """The accuracy budget lowers the model again per trial and each lowering decides storage (at debug); the
    info line is the plan's own, once, and counts the model's FP32 tensors it stores in bf16. Autotune off: timed,
    FP32 kernels can win every layer of this small block on a loaded machine, and then nothing is stored bf16."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="kiln.build"):
        engine = kiln.build(c2f_block(), bf16=True, tactic_sources=KILN_ONLY, autotune=False, accuracy="l2:0.0015")
    storage = [r for r in caplog.records if r.getMessage().startswith("Storage: ")]
    assert len([r for r in storage if r.levelno == logging.DEBUG]) >= 2   # trials, each deciding its own storage
    stored = {t.name for layer in engine.plan.layers for t in layer.outputs if t.dtype == "bfloat16"}
    info = [r.getMessage() for r in storage if r.levelno == logging.INFO]
    assert info == ([f"Storage: {len(stored)} tensors between BF16 kernels stored in BF16 (conversions fused into "
                     "their kernels)"] if stored else [])
