"""kiln's oneDNN primitives on a dynamic engine's many input shapes: each shape's primitive reads the packed weights
made at load (no copy per shape), convolutions keep only the SHAPES_KEPT last used shapes' primitives, linear layers
whose rows vary keep the first SHAPES_KEPT and run every later row count on one product made for any number of
rows; every output against the formula, FP32, BF16 and INT8. Before, a BERT engine served with 64 sequence lengths
held 1025 primitives, each with its own copy of its weights."""
from __future__ import annotations

import gc

import pytest
import torch

from kiln.native import external
from kiln.tactics import onednn_prim
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.onednn_int8 import int8_available
from kiln.tactics.onednn_prim import Primitive, PrimitiveInt8ConvTactic
from kiln.tactics.onednn_prim_float import PrimitiveConvTactic
from kiln.tactics.onednn_prim_linear import PrimitiveBf16LinearTactic, PrimitiveInt8LinearTactic, \
    PrimitiveLinearTactic, rows_vary
from tests.tactics.test_onednn_int8 import close_quantized, linear_formula
from tests.tactics.test_onednn_int8 import conv_view as int8_conv_view
from tests.tactics.test_onednn_int8 import formula as int8_conv_formula
from tests.tactics.test_onednn_int8 import linear_view as int8_linear_view
from tests.tactics.test_onednn_prim_float import conv_view
from tests.tactics.test_onednn_prim_float import formula as conv_formula
from tests.tactics.test_onednn_prim_linear import formula as linear_formula_float
from tests.tactics.test_onednn_prim_linear import linear_view

pytestmark = pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here (pip "
                                f"install {external.ONEDNN_WHEELS})")
KEPT = 3


@pytest.fixture(autouse=True)
def few_shapes_kept(monkeypatch):
    monkeypatch.setattr(onednn_prim, "SHAPES_KEPT", KEPT)


def live_primitives() -> dict[int, Primitive]:
    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(type(o), type) and issubclass(type(o), Primitive)}


def made_since(before: dict[int, Primitive]) -> list[Primitive]:
    return [p for key, p in live_primitives().items() if key not in before]


def dynamic(view: LayerView, axes: tuple[int, ...]) -> LayerView:
    """`view` with input 0's `axes` varying with the engine's input shapes."""
    return LayerView(view.op_type, view.domain, view.attrs, view.input_shapes, view.input_dtypes, view.const_inputs,
                     view.output_dtypes, view.opset, (axes,) + tuple(() for _ in view.input_shapes[1:]))


def test_convolution_shapes_share_the_packed_weights_and_only_the_last_used_are_kept():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, 3, 3, generator=g) * 0.2, torch.randn(24, generator=g)
    view = dynamic(conv_view((1, 16, 12, 12), weight, bias, (1, 1, 1, 1), activation={"op": "Relu"}), (0, 2, 3))
    before = live_primitives()
    kernel = PrimitiveConvTactic().prepare(view)
    shapes = [(1, 16, 12, 12), (2, 16, 12, 12), (1, 16, 20, 9), (3, 16, 7, 7), (2, 16, 16, 16), (1, 16, 12, 12)]
    for shape in shapes * 2:
        x = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(kernel([x, None, None])[0], conv_formula(view, x, None), rtol=1e-4, atol=1e-4)
    made = made_since(before)
    assert len(made) <= KEPT + 1   # the kept shapes' and the first (its packed weights are the others')
    assert sum(p.weights_owner is None for p in made) <= 2   # the first's copy, and 7x7's where its layout differs


@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("tactic", [PrimitiveLinearTactic(), pytest.param(PrimitiveBf16LinearTactic(), marks=(
    pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16: oneDNN's BF16 matmul is not "
                       "offered")))], ids=["fp32", "bf16"])
def test_linear_rows_past_the_kept_counts_run_on_one_product_for_any_row_count(tactic, residual, monkeypatch):
    """The residual summed where the output is written, in the output's type (bf16 here for BF16)."""
    any_rows_made = []

    class Recording(Primitive):
        def __init__(self, lib, kind, call, share=None):
            super().__init__(lib, kind, call, share)
            any_rows_made.extend([call.m] if call.any_rows else [])

    monkeypatch.setattr(onednn_prim, "Primitive", Recording)
    dtypes = ("bfloat16",) * 3 if tactic.compute_dtype == torch.bfloat16 else ("float32",) * 3
    view = dynamic(linear_view((2, 8, 48), 48, 40, activation={"op": "Gelu", "attrs": {}}, residual=residual,
                               dtypes=dtypes), (0, 1))
    assert rows_vary(view)
    before = live_primitives()
    kernel = tactic.prepare(view)
    g = torch.Generator().manual_seed(1)
    for seq in [8, 1, 5, 3, 9, 17, 2, 64, 5, 1]:   # 16 rows planned; 2 and 10 fill the kept shapes
        x = torch.randn(2, seq, 48, generator=g).to(getattr(torch, dtypes[0]))
        r = torch.randn(2, seq, 40, generator=g).to(x.dtype) if residual else None
        got = kernel([x, None, None] + ([r] if residual else []))[0]
        assert got.shape == (2, seq, 40)
        want = linear_formula_float(view, x, r, rounded=tactic.compute_dtype == torch.bfloat16)
        torch.testing.assert_close(got.float(), want, rtol=1e-2 if got.dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    assert any_rows_made == [6]   # made once, at the first count past the kept ones (seq 3)
    made = made_since(before)
    assert len(made) == KEPT + 1   # the kept row counts' (the planned one among them) and the any-rows product
    # copies of the weights: the first's, and the any-rows product's where its kernel wants another layout
    assert sum(p.weights_owner is None for p in made) <= 2


def test_rows_vary_only_where_a_leading_axis_is_dynamic():
    view = linear_view((16, 48), 48, 40)
    assert not rows_vary(view) and rows_vary(dynamic(view, (0,))) and not rows_vary(dynamic(view, (1,)))


@pytest.mark.skipif(not int8_available(), reason="this CPU has neither VNNI nor AMX-INT8: kiln offers no oneDNN "
                    "INT8 kernel")
def test_int8_linear_rows_past_the_kept_counts_match_the_formula():
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (48, 40), generator=g, dtype=torch.int8)
    view = dynamic(int8_linear_view("QMatMul", (1, 7, 48), w), (0, 1))
    kernel = PrimitiveInt8LinearTactic().prepare(view)
    for seq in [7, 2, 3, 4, 5, 11, 1]:
        x = torch.randint(0, 256, (1, seq, 48), generator=g, dtype=torch.uint8)
        got = kernel([x, None, None])[0]
        assert got.shape == (1, seq, 40)
        close_quantized(got, linear_formula(view, x))


@pytest.mark.skipif(not int8_available(), reason="this CPU has neither VNNI nor AMX-INT8: kiln offers no oneDNN "
                    "INT8 kernel")
def test_int8_convolution_shapes_read_the_first_ones_weights_and_compensation():
    """oneDNN packs an INT8 convolution's zero-point compensation with its weights: a shape reading the first one's
    packed weights reads that too (a padded 3x3 with a source zero point, batch and size varying)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (16, 8, 3, 3), generator=g, dtype=torch.int8)
    view = dynamic(int8_conv_view((1, 8, 10, 10), w, act="Relu"), (0, 2, 3))
    before = live_primitives()
    kernel = PrimitiveInt8ConvTactic().prepare(view)
    for shape in [(1, 8, 10, 10), (2, 8, 10, 10), (1, 8, 17, 6), (3, 8, 9, 9), (1, 8, 10, 10)]:
        x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        close_quantized(kernel([x, None, None])[0], int8_conv_formula(view, x))
    assert sum(p.weights_owner is None for p in made_since(before)) <= 2


def test_a_product_refused_for_any_row_count_falls_back_to_shapes_replacing_each_other(monkeypatch):
    view = dynamic(linear_view((4, 48), 48, 40), (0,))
    made_any_rows = []

    class Refusing(Primitive):
        def __init__(self, lib, kind, call, share=None):
            if call.any_rows:
                made_any_rows.append(call.m)
                raise RuntimeError("oneDNN made no matrix product for this layer: no kernel")
            super().__init__(lib, kind, call, share)

    monkeypatch.setattr(onednn_prim, "Primitive", Refusing)
    kernel = PrimitiveLinearTactic().prepare(view)
    g = torch.Generator().manual_seed(3)
    for rows in [4, 1, 2, 3, 5, 6, 1]:
        x = torch.randn(rows, 48, generator=g)
        torch.testing.assert_close(kernel([x, None, None])[0], linear_formula_float(view, x), rtol=1e-5, atol=1e-5)
    assert made_any_rows == [3]   # tried once, at the first row count past the kept ones


def test_weights_are_shared_only_where_the_layout_is_the_same():
    """The packed layout of oneDNN's convolution can change with the spatial size (7x7 against 56x56 here on
    AVX-512): a shape whose kernel wants another layout packs its own copy, and its output is still right."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 64, 3, 3, generator=g) * 0.1
    view = dynamic(conv_view((1, 64, 56, 56), weight, None, (1, 1, 1, 1)), (2, 3))
    kernel = PrimitiveConvTactic().prepare(view)
    for shape in [(1, 64, 7, 7), (1, 64, 28, 28), (1, 64, 56, 56)]:
        x = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(kernel([x, None, None])[0], conv_formula(view, x, None), rtol=1e-4, atol=1e-4)
