"""kiln's C rotary embedding (kiln.tactics.rotary_c) against x·cos + rotate_half(x)·sin computed by torch in float64:
tables broadcast over heads and batches by strides (never expanded), per-batch positions, constant tables, 2-D and
3-D inputs, a strided input, heads as wide as 2 and 80; bf16 storage in any mix, rounded once; and what it
declines."""
from __future__ import annotations

import pytest
import torch

from kiln import native
from kiln.ops.fused import rotary_embedding
from kiln.tactics.base import LayerView
from kiln.tactics.rotary_c import RotaryBf16Tactic, RotaryTactic

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: kiln's C kernels are not built here")


def layer(x, cos, sin, dtypes=("float32",) * 4, consts=None) -> LayerView:
    return LayerView("RotaryEmbedding", "kiln", {}, (tuple(x), tuple(cos), tuple(sin)), dtypes[:3], consts or {},
                     dtypes[3:], 17, ((),) * 3)


def formula(x, cos, sin) -> torch.Tensor:
    """HF's apply_rotary_pos_emb written out in float64: x * cos + rotate_half(x) * sin."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_kilns_reference_op_is_the_formula():
    """The op's torch reference (what the reference tactic and regions' checks run) against the formula."""
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cos, sin = (t.double() for t in tables((5, 8), seed=1))
    torch.testing.assert_close(rotary_embedding({}, [x, cos, sin])[0], formula(x, cos, sin), rtol=0, atol=1e-15)


def tables(shape, seed):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(shape, generator=g, dtype=torch.float64) * 6.3
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("x_shape,table_shape", [
    ((1, 8, 128, 32), (1, 1, 128, 32)),   # LLaMA's Q: one table row per position, shared by every head
    ((2, 3, 7, 80), (2, 1, 7, 80)),       # per-batch positions (left padding), head size 80
    ((2, 6, 4, 16), (6, 1, 16)),          # [B, S, H, D] with [S, 1, D]: the table broadcast over heads in the middle
    ((5, 2), (5, 2)),                     # 2-D, the narrowest rotation
    ((3, 7, 64), (7, 64)),                # [B, S, D] before the head split
])
def test_fp32_matches_the_formula(x_shape, table_shape):
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(1))
    cos, sin = tables(table_shape, seed=2)
    view = layer(x_shape, table_shape, table_shape)
    assert RotaryTactic().supports(view)
    got = RotaryTactic().prepare(view)([x, cos, sin])[0]
    torch.testing.assert_close(got.double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_constant_tables_and_a_strided_input():
    """Static positions fold cos and sin to constants (the layer's const inputs); x arrives as a transposed view."""
    cos, sin = tables((6, 8), seed=3)
    view = layer((2, 4, 6, 8), (6, 8), (6, 8), consts={1: cos, 2: sin})
    x = torch.randn(2, 6, 4, 8, generator=torch.Generator().manual_seed(4)).transpose(1, 2)
    got = RotaryTactic().prepare(view)([x, None, None])[0]
    assert got.is_contiguous()
    torch.testing.assert_close(got.double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtypes", [("bfloat16",) * 4, ("bfloat16", "float32", "float32", "float32"),
                                    ("float32", "bfloat16", "float32", "bfloat16")])
def test_bf16_storage_computes_in_fp32_and_rounds_once(dtypes):
    x = torch.randn(1, 4, 9, 32, generator=torch.Generator().manual_seed(5))
    cos, sin = tables((1, 1, 9, 32), seed=6)
    xs = [t.bfloat16() if d == "bfloat16" else t for t, d in zip((x, cos, sin), dtypes)]
    got = RotaryBf16Tactic().prepare(layer(x.shape, cos.shape, sin.shape, dtypes))(xs)[0]
    want = formula(*xs)   # the stored inputs, exactly
    assert got.dtype == (torch.bfloat16 if dtypes[3] == "bfloat16" else torch.float32)
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want.float().bfloat16())   # FP32 arithmetic, one rounding to nearest even
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_cos_and_sin_of_different_shapes_and_strides():
    """cos per batch (left padding), sin one table for all with rows 32 apart: each read through its own strides."""
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(35))
    cos, _ = tables((2, 1, 7, 16), seed=36)
    sin = tables((7, 32), seed=37)[1][:, :16]
    got = RotaryTactic().prepare(layer(x.shape, cos.shape, sin.shape))([x, cos, sin])[0]
    torch.testing.assert_close(got.double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_tables_without_unit_inner_stride_and_a_second_call_with_other_strides():
    """Column-major tables are made row-major first; the same kernel called again with tables of other strides (one
    geometry per strides, not per shape) reads them right."""
    x = torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(38))
    kernel = RotaryTactic().prepare(layer(x.shape, (7, 16), (7, 16)))
    cos, sin = (t.t().contiguous().t() for t in tables((7, 16), seed=39))
    assert cos.stride(-1) != 1
    torch.testing.assert_close(kernel([x, cos, sin])[0].double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)
    cos, sin = tables((7, 16), seed=40)
    torch.testing.assert_close(kernel([x, cos, sin])[0].double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)
    wide = [t[:, :16] for t in tables((7, 32), seed=41)]   # same shape, rows 32 apart
    torch.testing.assert_close(kernel([x, *wide])[0].double(), formula(x, *wide), rtol=1e-6, atol=1e-6)


def test_a_row_wider_than_the_kernel_stages_is_refused_at_the_call():
    view = layer((1, 4), (1, 4), (1, 4))
    x = torch.ones(1, 2048)
    with pytest.raises(ValueError, match=r"kiln.rotary: x shaped \[1, 2048\]: rows must be even and at most 1024"):
        RotaryTactic().prepare(view)([x, torch.ones(1, 2048), torch.ones(1, 2048)])


def test_declines_what_it_cannot_run():
    tactic = RotaryTactic()
    assert not tactic.supports(layer((1, 2, 3, 7), (3, 7), (3, 7)))          # odd width: no halves
    assert not tactic.supports(layer((1, 2, 3, 8), (3, 4), (3, 4)))          # half-wide tables (ONNX's caches)
    assert not tactic.supports(layer((1, 2, 3, 8), (3, 8), (3, 8), ("bfloat16",) * 4))   # FP32 only
    assert not tactic.supports(layer((1, 1, 2, 3, 2, 8), (2, 8), (2, 8)))    # more leading axes than it walks
    assert not tactic.supports(layer((7, 8), (1, 7, 8), (1, 7, 8)))          # a table that would enlarge x
    assert not tactic.supports(layer((1, 2, 2048), (2, 2048), (2, 2048)))    # wider than the kernel's rows
    assert tactic.supports(layer((1, 2, 1024), (2, 1024), (2, 1024)))        # the widest it takes
    assert RotaryBf16Tactic().supports(layer((1, 2, 3, 8), (3, 8), (3, 8), ("bfloat16",) * 4)) == \
        RotaryBf16Tactic().supports(layer((1, 2, 3, 8), (3, 8), (3, 8)))    # offered where BF16 is, either storage


def test_emitted_for_an_onnxruntime_or_openvino_region_as_the_graph_wrote_it():
    """A region compiling the layer gets it back as Slice, Slice, Neg, Concat, Mul, Mul, Add."""
    import onnxruntime as ort

    from kiln.tactics.onnx_emit import emit

    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(7))
    cos, sin = tables((1, 1, 5, 8), seed=8)
    model, external = emit(layer(x.shape, cos.shape, sin.shape), 17)
    assert not external
    assert [n.op_type for n in model.graph.node] == ["Slice", "Slice", "Neg", "Concat", "Mul", "Mul", "Add"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x0": x.numpy(), "x1": cos.numpy(), "x2": sin.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got).double(), formula(x, cos, sin), rtol=1e-6, atol=1e-6)
