"""kiln's C attention (kiln.tactics.attention_c) on decoders' layers, against the float64 formula: grouped-query
attention (K and V expanded across groups of query heads by stride 0, read in place, packed once per group), causal
masks of -inf and of the float minimum with left padding (the keys a tile masks throughout skipped, rows masked
throughout NaN or uniform as onnxruntime gives), and masks whose live keys a tile's rows reach unevenly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln import native
from kiln.tactics.attention_c import AttentionBf16Tactic, AttentionTactic, call_geometry
from kiln.tactics.base import LayerView
from tests.tactics.test_attention_c import (FP32_REL, NEG_INF, assert_matches, expected, formula, heads_layer,
                                            inputs, needs_bf16)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: kiln's C kernels are not built here")


FLOAT_MIN = torch.finfo(torch.float32).min


def causal_mask(b: int, s: int, fill: float, padded: int = 0) -> torch.Tensor:
    """A decoder's causal mask [B, 1, S, S] filled with `fill` above the diagonal; batch 1 left-padded by `padded`
    keys (masked in every row, its first `padded` query rows masked throughout)."""
    mask = torch.zeros(s, s).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), fill).repeat(b, 1, 1, 1)
    if padded:
        mask[1:, :, :, :padded] = fill
    return mask


@pytest.mark.parametrize("fill", [NEG_INF, FLOAT_MIN])
def test_causal_masks_match_the_formula_with_their_dead_keys_skipped(fill):
    """Causal masks with -inf and with the float minimum (HF's exports), 77 keys (tiles across the diagonal), batch 2
    with left padding: the keys a tile's rows all mask are skipped, bit-for-bit harmless, so a NaN in V there is
    never read; rows masked throughout are NaN (-inf) or uniform over V (the float minimum), as onnxruntime gives."""
    layer = heads_layer(2, 3, 77, 77, 32, mask_shape=(2, 1, 77, 77))
    xs = inputs(layer, seed=21)
    xs[3] = causal_mask(2, 77, fill, padded=7)
    want = expected(layer, xs)
    got = AttentionTactic().prepare(layer)(xs)[0]
    assert_matches(got, want, FP32_REL)
    dead = got[1, :7]   # batch 1's padded query rows
    if fill == NEG_INF:
        assert bool(dead.isnan().all())
    else:
        torch.testing.assert_close(dead, xs[2][1].mean(0).reshape(1, -1).expand(7, -1), rtol=1e-5, atol=1e-5)
    xs[2][0, 76, 0] = float("nan")   # key 76 is live for row 76 alone: only its row tile reads it
    assert bool(AttentionTactic().prepare(layer)(xs)[0][0, :72].isfinite().all())


@needs_bf16
def test_bf16_causal_masks_skip_dead_keys():
    layer = heads_layer(2, 2, 77, 77, 32, mask_shape=(2, 1, 77, 77))
    xs = inputs(layer, seed=22)
    xs[3] = causal_mask(2, 77, FLOAT_MIN, padded=5)
    got = AttentionBf16Tactic().prepare(layer)(xs)[0]
    assert_matches(got, expected(layer, xs, round_bf16=True), 2 ** -8)


def test_a_key_broadcast_mask_keeps_every_key():
    """A mask broadcast along the keys (stride 0: [.., Sq, 1]) has no key order to cut: every key stays, the rows it
    masks throughout NaN as in the graph."""
    layer = heads_layer(1, 2, 12, 9, 16, mask_shape=(1, 1, 12, 1))
    xs = inputs(layer, seed=31)
    big = torch.full((24,), NEG_INF)
    big[:6] = 0.0
    xs[3] = big[:12].reshape(1, 1, 12, 1)   # a view: a kernel reading it along the keys would still stay in bounds
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], expected(layer, xs), FP32_REL)


def test_a_tile_whose_earlier_rows_reach_further_keys():
    """Row i keeps keys < 20 - i: a tile's live keys are the furthest any of its rows reaches, not its last row's."""
    layer = heads_layer(1, 2, 12, 20, 16, mask_shape=(1, 1, 12, 20))
    xs = inputs(layer, seed=32)
    keys = torch.arange(20)
    xs[3] = torch.where(keys[None, :] >= 20 - torch.arange(12)[:, None], NEG_INF, 0.0).reshape(1, 1, 12, 20)
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], expected(layer, xs), FP32_REL)


def gqa_layer(b, hkv, group, s, d, dtype="float32"):
    """LLaMA's, Mistral's and Qwen2's export of grouped-query attention: K and V [B, Hkv, S, D] unsqueezed and
    expanded across each group of query heads (a stride-0 axis), then reshaped to [B, Hkv * G, S, D]."""
    h = hkv * group
    attrs = {"scale": d ** -0.5, "q_steps": [], "k_steps": [{"reshape": [b, h, s, d]}, {"transpose": [0, 1, 3, 2]}],
             "v_steps": [{"reshape": [b, h, s, d]}],
             "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [b, s, h * d]}]}
    shapes = ((b, h, s, d), (b, hkv, group, s, d), (b, hkv, group, s, d), (1, 1, s, s))
    return LayerView("Attention", "kiln", attrs, shapes, (dtype,) * 3 + ("float32",), {}, (dtype,), 17, ((),) * 4)


def gqa_inputs(layer: LayerView, seed: int):
    """Q, K and V expanded by strides (as torch's Expand leaves them), and a causal mask."""
    b, hkv, group, s, d = layer.input_shapes[1]
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if layer.input_dtypes[0] == "bfloat16" else torch.float32
    q = torch.randn(b, hkv * group, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, 1, s, d, generator=g).to(dtype).expand(b, hkv, group, s, d) for _ in range(2))
    mask = torch.full((s, s), NEG_INF).triu(1).reshape(1, 1, s, s)
    want = formula(q, *(t.reshape(b, hkv * group, s, d) for t in (k, v)), mask, layer.attrs["scale"])
    return [q, k, v, mask], want.transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("b,hkv,group,s,d", [(1, 4, 2, 128, 32), (2, 3, 4, 37, 20), (1, 1, 6, 9, 16)])
def test_grouped_query_attention_reads_each_kv_head_in_place(b, hkv, group, s, d):
    """Each K/V head is read where it lies, once per group of query heads (no copy of the expanded K and V; the
    group in the call), 4 K/V heads of 2, odd sizes with batch 2, and one K/V head shared by all (multi-query)."""
    layer = gqa_layer(b, hkv, group, s, d)
    xs, want = gqa_inputs(layer, seed=group)
    geo = call_geometry(layer.attrs, xs, torch.float32, 0)
    assert geo.in_place
    if hkv > 1:
        assert geo.call.kv_group == group and (geo.call.k_h, geo.call.v_h) == (s * d, s * d)   # next K/V head
    else:   # one K/V head for all: a head stride of 0 is a view already
        assert geo.call.kv_group == 1 and (geo.call.k_h, geo.call.v_h) == (0, 0)
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], want, FP32_REL)


def test_k_and_v_grouped_differently_are_copied_and_run_on_the_kernel():
    """K expanded across groups of 2 query heads, V across groups of 4: no one group fits both, so both are read as
    the steps' copies (group 1), still on the kernel."""
    s, d = 8, 16
    layer = gqa_layer(1, 4, 2, s, d)
    layer = dataclasses.replace(layer, input_shapes=(*layer.input_shapes[:2], (1, 2, 4, s, d), (1, 1, s, s)))
    g = torch.Generator().manual_seed(34)
    q = torch.randn(1, 8, s, d, generator=g)
    k = torch.randn(1, 4, 1, s, d, generator=g).expand(1, 4, 2, s, d)
    v = torch.randn(1, 2, 1, s, d, generator=g).expand(1, 2, 4, s, d)
    mask = torch.full((s, s), NEG_INF).triu(1).reshape(1, 1, s, s)
    geo = call_geometry(layer.attrs, [q, k, v, mask], torch.float32, 0)
    assert geo.call is not None and not geo.in_place and geo.call.kv_group == 1
    want = formula(q, k.reshape(1, 8, s, d), v.reshape(1, 8, s, d), mask, layer.attrs["scale"])
    got = AttentionTactic().prepare(layer)([q, k, v, mask])[0]
    assert_matches(got, want.transpose(1, 2).reshape(1, s, -1), FP32_REL)


def test_k_shared_by_all_heads_and_v_per_head():
    """One K for every head (stride 0) and a V per head: a thread's packed K and V are reused only while both
    addresses repeat."""
    b, h, s, d = 1, 4, 24, 16
    attrs = {"scale": d ** -0.5, "q_steps": [], "k_steps": [{"transpose": [0, 1, 3, 2]}], "v_steps": [],
             "out_steps": []}
    layer = LayerView("Attention", "kiln", attrs, ((b, h, s, d), (b, 1, s, d), (b, h, s, d)), ("float32",) * 3, {},
                      ("float32",), 17, ((),) * 3)
    g = torch.Generator().manual_seed(33)
    q, k, v = (torch.randn(b, heads, s, d, generator=g) for heads in (h, 1, h))
    got = AttentionTactic().prepare(layer)([q, k, v])[0]
    assert_matches(got, formula(q, k.expand(b, h, s, d), v, None, attrs["scale"]), FP32_REL)


@needs_bf16
def test_bf16_grouped_query_attention():
    layer = gqa_layer(1, 4, 2, 40, 32, dtype="bfloat16")
    xs, want = gqa_inputs(layer, seed=11)
    got = AttentionBf16Tactic().prepare(layer)(xs)[0]
    assert got.dtype == torch.bfloat16 and call_geometry(layer.attrs, xs, torch.bfloat16, 0).call.kv_group == 2
    assert_matches(got, want, 2 ** -7)
