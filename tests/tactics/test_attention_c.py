"""kiln's C attention (kiln.tactics.attention_c) against the formula softmax(Q·Kᵀ·scale + mask)·V computed by torch
in float64: BERT's strided Q/K/V slices of one fused QKV tensor, odd sizes (Sq ≠ Sk, S = 1, S = 77, head sizes
that are not a multiple of 16, Dv ≠ D), masks of every rank broadcast by strides, rows whose every key is -inf
(NaN, or 0 under the NaN guard), batch > 1, bf16 inputs and outputs in any mix; the BF16-math variant against the
same formula on bf16-rounded operands; and small encoders built by kiln with their Attention layers on these
kernels, matching onnxruntime."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kiln
from kiln import hardware, native
from kiln.tactics.attention_c import (ATTENTION_BF16_TACTIC, ATTENTION_TACTIC, AttentionBf16Tactic,
                                      AttentionTactic, call_geometry, input_addresses, viewed_steps)
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA
from tests.conftest import assert_close_to_ort, cosine, run_ort
from tests.tactics.avx2 import avx2_build

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: kiln's C kernels are not built here")
needs_bf16 = pytest.mark.skipif(not hardware.has_any(BF16_DOT_ISA),
                                reason="this CPU has no AVX512-BF16 (vdpbf16ps): kiln.attention_c_bf16 is not "
                                       "offered here, and kiln.attention_c's FP32 math is tested instead")
NEG_INF = float("-inf")
HEAD_STEPS = {"q": [{"transpose": [0, 2, 1, 3]}], "k": [{"transpose": [0, 2, 3, 1]}],
              "v": [{"transpose": [0, 2, 1, 3]}]}


def formula(q, k, v, mask, scale: float, nan_to_zero: bool = False) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v in float64 (q, k, v [..., S, D]); a -inf row gives NaN, as ONNX's Softmax."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask.double()
    out = torch.softmax(s, dim=-1) @ v.double()
    return torch.where(out.isnan(), 0.0, out) if nan_to_zero else out


def heads_layer(b, h, sq, sk, d, dv=None, mask_shape=None, dtypes=("float32",) * 3, out="float32", **attrs):
    """An Attention layer on separate Q [B, Sq, H, D], K [B, Sk, H, D], V [B, Sk, H, Dv] inputs (the head transposes
    as its steps), its output merged back to [B, Sq, H * Dv]."""
    dv = dv or d
    shapes = [(b, sq, h, d), (b, sk, h, d), (b, sk, h, dv)] + ([mask_shape] if mask_shape is not None else [])
    attrs = {"scale": 1 / d ** 0.5, "q_steps": HEAD_STEPS["q"], "k_steps": HEAD_STEPS["k"],
             "v_steps": HEAD_STEPS["v"], "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [b, sq, h * dv]}],
             **attrs}
    in_dtypes = tuple(dtypes) + (("float32",) if mask_shape is not None else ())
    return LayerView("Attention", "kiln", attrs, tuple(shapes), in_dtypes, {}, (out,), 17, tuple(() for _ in shapes))


def inputs(layer: LayerView, seed: int, masked=()) -> list[torch.Tensor]:
    """Random inputs of the layer's shapes and dtypes; the mask random with -inf at index tuples `masked`."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g).to(torch.bfloat16 if t == "bfloat16" else torch.float32)
          for s, t in zip(layer.input_shapes, layer.input_dtypes)]
    if len(xs) > 3:
        for index in masked:
            xs[3][index] = NEG_INF
    return xs


def expected(layer: LayerView, xs, round_bf16: bool = False) -> torch.Tensor:
    """The formula on the layer's inputs after their steps, merged like its output ([B, Sq, H * Dv])."""
    q, k, v = (x.float() for x in xs[:3])
    if round_bf16:
        q, k, v = (t.bfloat16().float() for t in (q, k, v))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = formula(q, k, v, xs[3] if len(xs) > 3 else None, layer.attrs["scale"], layer.attrs.get("nan_to_zero", False))
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def assert_matches(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """max |got - want| <= rel * max |want| over the finite entries, and NaN exactly where `want` has NaN."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), "NaN in different places"
    finite = ~want.isnan()
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * {scale:.3g}"


FP32_REL = 1e-5


def test_bert_base_layer_reads_the_fused_qkv_slices_in_place():
    """BERT-base: Q, K, V are column slices of one [1, 128, 2304] tensor, split into 12 heads of 64."""
    s, h, d = 128, 12, 64
    attrs = {"scale": 0.125, "nan_to_zero": False,
             "q_steps": [{"slice": [2, 0, 768]}, {"reshape": [1, s, h, d]}, {"transpose": [0, 2, 1, 3]}],
             "k_steps": [{"slice": [2, 768, 1536]}, {"reshape": [1, s, h, d]}, {"transpose": [0, 2, 3, 1]}],
             "v_steps": [{"slice": [2, 1536, 2304]}, {"reshape": [1, s, h, d]}, {"transpose": [0, 2, 1, 3]}],
             "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [1, s, h * d]}]}
    layer = LayerView("Attention", "kiln", attrs, ((1, s, 3 * h * d),) * 3 + ((1, 1, s, s),), ("float32",) * 4, {},
                      ("float32",), 17, ((),) * 4)
    g = torch.Generator().manual_seed(1)
    qkv, mask = torch.randn(1, s, 3 * h * d, generator=g), torch.zeros(1, 1, s, s)
    mask[..., 100:] = -10000.0   # BERT's padding mask
    geo = call_geometry(attrs, [qkv, qkv, qkv, mask], torch.float32, 0)
    assert geo.in_place and geo.direct   # no copy of Q, K, V, the output written in its merged layout
    assert (geo.call.q_at, geo.call.k_at, geo.call.v_at, geo.call.m_at) == (0, 768 * 4, 1536 * 4, 0)   # bytes
    got = AttentionTactic().prepare(layer)([qkv, qkv, qkv, mask])[0]
    q, k, v = (qkv[..., i * 768:(i + 1) * 768].reshape(1, s, h, d).transpose(1, 2) for i in range(3))
    want = formula(q, k, v, mask, 0.125).transpose(1, 2).reshape(1, s, h * d)
    assert_matches(got, want, FP32_REL)


@pytest.mark.parametrize("b,h,sq,sk,d,dv", [
    (1, 2, 128, 128, 64, 64),
    (2, 3, 77, 77, 32, 32),     # batch > 1, S = 77 (CLIP's text length): a partial row tile and key panel
    (1, 2, 1, 1, 64, 64),       # one query, one key
    (1, 1, 1, 77, 80, 80),      # one query over 77 keys (a decoder step); head size 80
    (2, 2, 5, 19, 20, 20),      # Sq != Sk, head size 20: not a multiple of 16
    (1, 3, 33, 7, 17, 40),      # odd head size, Dv != D
    (1, 1, 200, 50, 16, 16),    # one head of 34 row tiles: split into row blocks where there are 2+ threads
])
def test_fp32_matches_the_formula_for_odd_sizes(b, h, sq, sk, d, dv):
    layer = heads_layer(b, h, sq, sk, d, dv, mask_shape=(b, 1, 1, sk))
    xs = inputs(layer, seed=sq + sk + d)
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], expected(layer, xs), FP32_REL)


@pytest.mark.parametrize("mask_shape", [None, (9,), (6, 9), (1, 6, 9), (2, 1, 6, 9), (2, 1, 1, 9), (1, 3, 1, 9),
                                        (2, 3, 6, 9), (1, 1, 6, 1), (2, 3, 6, 1)],
                         ids=lambda s: "none" if s is None else "x".join(map(str, s)))
def test_masks_of_every_rank_broadcast_by_strides(mask_shape):
    layer = heads_layer(2, 3, 6, 9, 16, mask_shape=mask_shape)
    xs = inputs(layer, seed=5)
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], expected(layer, xs), FP32_REL)


def test_an_absent_mask_slot_and_inputs_that_are_views():
    """A layer whose mask slot is planned empty (None) takes the general readers. Q, K and V are views starting 20
    bytes into their storage: the call takes the views' own addresses (the steps add no offset here), 0 for the
    mask."""
    base = heads_layer(2, 3, 6, 9, 16)
    layer = dataclasses.replace(base, input_shapes=base.input_shapes + (None,), input_dtypes=base.input_dtypes + (None,),
                                input_dynamic=base.input_dynamic + ((),))
    g = torch.Generator().manual_seed(8)
    wide = [torch.randn(s[0], s[1], s[2], s[3] + 5, generator=g) for s in base.input_shapes]
    xs = [w[..., 5:] for w in wide] + [None]   # offset 20 bytes into each storage, unit inner stride
    geo = call_geometry(layer.attrs, xs, torch.float32, 0)
    assert geo.in_place and (geo.call.q_at, geo.call.k_at, geo.call.v_at, geo.call.m_at) == (0, 0, 0, 0)
    assert input_addresses(xs) == [w.data_ptr() + 20 for w in wide] + [0]
    assert_matches(AttentionTactic().prepare(layer)(xs)[0], expected(base, xs[:3]), FP32_REL)


@pytest.mark.parametrize("nan_to_zero", [False, True])
def test_rows_whose_every_key_is_masked(nan_to_zero):
    """A -inf row gives NaN, as the ONNX graph's Softmax does; with the NaN guard (SDPA's export), 0. A row with one
    key left attends to that key alone."""
    layer = heads_layer(2, 2, 4, 5, 16, mask_shape=(2, 1, 4, 5), nan_to_zero=nan_to_zero)
    xs = inputs(layer, seed=6, masked=[(0, 0, 1), (1, 0, 3), (1, 0, 2, slice(1, 5))])
    got = AttentionTactic().prepare(layer)(xs)[0]   # [B, Sq, H * D]
    assert_matches(got, expected(layer, xs), FP32_REL)
    dead = got[0, 1], got[1, 3]
    assert all(bool((row == 0).all()) if nan_to_zero else bool(row.isnan().all()) for row in dead)
    torch.testing.assert_close(got[1, 2].reshape(2, 16), xs[2][1, 0], rtol=1e-6, atol=1e-6)   # only key 0 left



@pytest.mark.parametrize("q,k,v,out", [("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
                                       ("bfloat16", "float32", "bfloat16", "float32"),
                                       ("float32", "bfloat16", "float32", "bfloat16"),
                                       ("float32", "float32", "float32", "bfloat16")])
def test_fp32_math_reads_and_writes_bf16_as_the_plan_stores_it(q, k, v, out):
    layer = heads_layer(2, 2, 13, 21, 24, mask_shape=(2, 1, 1, 21), dtypes=(q, k, v), out=out)
    xs = inputs(layer, seed=7)
    got = AttentionTactic().prepare(layer)(xs)[0]
    assert got.dtype == (torch.bfloat16 if out == "bfloat16" else torch.float32)
    # bf16 inputs are exact in FP32: the FP32 formula on them; a bf16 output is that result rounded (half an ulp)
    assert_matches(got, expected(layer, xs), 2 ** -8 if out == "bfloat16" else FP32_REL)


def test_bf16_output_is_the_fp32_result_rounded_to_nearest_even():
    """The kernel rounds its FP32 result as torch's .bfloat16() does, NaN rows included (a row tail of 13)."""
    fp32, bf16 = (heads_layer(1, 2, 6, 7, 29, mask_shape=(1, 1, 6, 7), out=out) for out in ("float32", "bfloat16"))
    xs = inputs(fp32, seed=11, masked=[(0, 0, 4)])
    want = AttentionTactic().prepare(fp32)(xs)[0]
    got = AttentionTactic().prepare(bf16)(xs)[0]
    assert want[0, 4].isnan().all() and got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan())   # NaN's payload bits may differ
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].bfloat16().view(torch.int16))


def test_views_without_unit_inner_stride_and_outputs_that_are_not_views():
    """Q given as [B, H, D, S] (its steps transpose the last two axes: not unit inner stride, copied), an output
    layout the steps cannot undo as a view (written contiguous, then reshaped); and shapes changing between calls
    (a dynamic axis): each geometry worked out once."""
    b, h, s, d = 2, 3, 10, 8
    attrs = {"scale": 0.3, "q_steps": [{"transpose": [0, 1, 3, 2]}], "k_steps": [],
             "out_steps": [{"transpose": [0, 2, 3, 1]}, {"reshape": [0, -1]}]}
    layer = LayerView("Attention", "kiln", attrs, ((b, h, d, s), (b, h, d, s), (b, h, s, d)), ("float32",) * 3, {},
                      ("float32",), 17, ((0, 3), (0, 3), (0, 2)))
    kernel = AttentionTactic().prepare(layer)
    for batch, seq in [(b, s), (1, 3), (b, s)]:
        g = torch.Generator().manual_seed(batch * seq)
        qt, kt, v = (torch.randn(batch, h, d, seq, generator=g), torch.randn(batch, h, d, seq, generator=g),
                     torch.randn(batch, h, seq, d, generator=g))
        geo = call_geometry(attrs, [qt, kt, v], torch.float32, 0)
        assert not geo.in_place and not geo.direct
        want = formula(qt.transpose(2, 3), kt.transpose(2, 3), v, None, 0.3).permute(0, 2, 3, 1).reshape(batch, -1)
        assert_matches(kernel([qt, kt, v])[0], want, FP32_REL)



def test_steps_through_a_shape_no_view_gives_still_read_in_place():
    """Batch-first nn.MultiheadAttention (batch 2): the packed [S, B, 3D] projection goes through [S, B*H, Dh],
    which no view of it gives, to Q [B, H, S, Dh], which is one: Q, K and V are read in place all the same."""
    s, b, h, d = 6, 2, 3, 4
    packed = [{"reshape": [s, b, 3, h * d]}, {"transpose": [2, 0, 1, 3]}]
    steps = [packed + [{"slice": [0, i, i + 1]}, {"reshape": [s, b * h, d]}, {"transpose": [1, 0, 2]},
                       {"reshape": [b, h, s, d]}] for i in range(3)]
    attrs = {"scale": 0.5, "q_steps": steps[0], "k_steps": steps[1] + [{"transpose": [0, 1, 3, 2]}],
             "v_steps": steps[2], "out_steps": [{"transpose": [2, 0, 1, 3]}, {"reshape": [s, b, h * d]}]}
    layer = LayerView("Attention", "kiln", attrs, ((s, b, 3 * h * d),) * 3, ("float32",) * 3, {}, ("float32",), 17,
                      ((),) * 3)
    qkv = torch.randn(s + 1, b, 3 * h * d, generator=torch.Generator().manual_seed(5))[1:]   # a storage offset
    geo = call_geometry(attrs, [qkv] * 3, torch.float32, 0)
    assert geo.in_place and geo.direct
    assert (geo.call.q_at, geo.call.k_at, geo.call.v_at) == (0, h * d * 4, 2 * h * d * 4)   # bytes into a row
    q, k, v = (qkv.reshape(s, b, 3, h, d)[:, :, i].permute(1, 2, 0, 3) for i in range(3))
    want = formula(q, k, v, None, 0.5).permute(2, 0, 1, 3).reshape(s, b, h * d)
    assert_matches(AttentionTactic().prepare(layer)([qkv] * 3)[0], want, FP32_REL)



def test_steps_whose_result_is_no_view_are_copied():
    """A head split written as q.transpose(1, 2).reshape(B, H, S, Dh): its offsets are no strided grid (the grid
    the first elements suggest runs past the tensor), so the steps' copy is read, not a wrong view."""
    x = torch.arange(48.0).reshape(1, 6, 8)
    steps = [{"transpose": [0, 2, 1]}, {"reshape": [1, 2, 6, 4]}]
    got = viewed_steps(x, steps)
    assert torch.equal(got, x.transpose(1, 2).reshape(1, 2, 6, 4)) and got.data_ptr() != x.data_ptr()
    s, b, d = 3, 2, 8   # rows b0s0, b0s1, .., b1s0: no strided grid; the layer reads the copy, not in place
    rows = [{"transpose": [1, 0, 2]}, {"reshape": [1, 1, b * s, d]}]
    attrs = {"scale": 0.5, "q_steps": rows, "k_steps": rows + [{"transpose": [0, 1, 3, 2]}], "v_steps": rows}
    layer = LayerView("Attention", "kiln", attrs, ((s, b, d),) * 3, ("float32",) * 3, {}, ("float32",), 17, ((),) * 3)
    y = torch.randn(s, b, d, generator=torch.Generator().manual_seed(3))
    q = y.transpose(0, 1).reshape(1, 1, b * s, d)
    assert not call_geometry(attrs, [y] * 3, torch.float32, 0).in_place
    assert_matches(AttentionTactic().prepare(layer)([y] * 3)[0], formula(q, q, q, None, 0.5), FP32_REL)
    split = [{"reshape": [1, 6, 2, 4]}, {"transpose": [0, 2, 1, 3]}]   # the usual split: a view
    assert torch.equal(viewed_steps(x, split), x.reshape(1, 6, 2, 4).transpose(1, 2))
    assert viewed_steps(x, split).data_ptr() == x.data_ptr()


@pytest.mark.skipif(not hardware.has_any(("avx2",)), reason="this CPU has no AVX2")
def test_the_avx2_build_matches_the_formula(tmp_path):
    """attention.c compiled for AVX2 alone (-march=x86-64-v3: 8-float vectors, 6 x 16 tiles, as on a Zen 3), run
    here on the same geometry the tactic computes."""
    lib = avx2_build("attention", tmp_path)
    layer = heads_layer(2, 3, 37, 21, 20, 40, mask_shape=(2, 1, 37, 21), out="bfloat16")
    xs = inputs(layer, seed=12, masked=[(0, 0, 3)])
    geo = call_geometry(layer.attrs, xs, torch.bfloat16, 0)
    assert geo.in_place and geo.direct
    y = geo.new_output()
    lib.kiln_attention(geo.call_ref, *input_addresses(xs), y.data_ptr())
    assert_matches(y, expected(layer, xs), 2 ** -8)


def test_channel_major_maps_are_read_in_place_and_the_output_written_channel_major():
    """A latent-diffusion VAE attention block between 1x1 convolutions: Q, K, V are [B, C, H, W] maps stored
    channel-major (NHWC), the steps flatten them to [B, C, HW] and transpose (V'·Pᵀ, so V and the output carry a
    swap); the kernel reads the maps in place and writes the output channel-major, as `output_format` promises."""
    b, c, h, w = 1, 24, 5, 7
    flat, swap = {"reshape": [b, c, h * w]}, {"transpose": [0, 2, 1]}
    attrs = {"scale": c ** -0.5, "q_steps": [flat, swap], "k_steps": [flat], "v_steps": [flat, swap],
             "out_steps": [swap, {"reshape": [b, c, h, w]}]}
    layer = LayerView("Attention", "kiln", attrs, ((b, c, h, w),) * 3, ("float32",) * 3, {}, ("float32",), 17,
                      ((),) * 3)
    g = torch.Generator().manual_seed(3)
    maps = [torch.randn(b, c, h, w, generator=g) for _ in range(3)]
    nhwc = [x.contiguous(memory_format=torch.channels_last) for x in maps]
    tactic = AttentionTactic()
    assert tactic.output_format(layer, ["hwc", "hwc", "hwc"]) == "hwc"
    assert tactic.output_format(layer, ["linear"] * 3) == "linear"
    geo = call_geometry(attrs, nhwc, torch.float32, 0)
    assert geo.in_place and geo.direct
    y = tactic.prepare(layer)(nhwc)[0]
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    q, k, v = (x.reshape(b, c, h * w) for x in maps)
    want = formula(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, c ** -0.5).transpose(1, 2)
    assert_matches(y, want.reshape(b, c, h, w), FP32_REL)
    assert_matches(tactic.prepare(layer)(maps)[0], want.reshape(b, c, h, w), FP32_REL)   # row-major maps too


def test_three_dimensional_heads_and_a_constant_mask():
    """Q, K, V as [N, S, D] (heads folded into the batch) and a float16 mask held by the layer as a constant."""
    n, sq, sk, d = 4, 6, 11, 16
    mask = torch.randn(sq, sk).half()
    layer = LayerView("Attention", "kiln", {"scale": 0.25, "k_steps": [{"transpose": [0, 2, 1]}]},
                      ((n, sq, d), (n, sk, d), (n, sk, d), (sq, sk)), ("float32", "float32", "float32", "float16"),
                      {3: mask}, ("float32",), 17, ((),) * 4)
    assert AttentionTactic().supports(layer)
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(n, sq, d, generator=g), torch.randn(n, sk, d, generator=g), torch.randn(n, sk, d, generator=g)
    got = AttentionTactic().prepare(layer)([q, k, v, None])[0]
    assert_matches(got, formula(q, k, v, mask.float(), 0.25), FP32_REL)


def test_declines_what_it_cannot_run():
    ok = heads_layer(1, 2, 4, 4, 8, mask_shape=(1, 1, 4, 4))
    assert AttentionTactic().supports(ok)
    fp16 = heads_layer(1, 2, 4, 4, 8, dtypes=("float16",) * 3)
    bool_mask = LayerView("Attention", "kiln", ok.attrs, ok.input_shapes, ok.input_dtypes[:3] + ("bool",), {},
                          ("float32",), 17, ok.input_dynamic)
    five_d = LayerView("Attention", "kiln", {"scale": 1.0, "k_steps": [{"transpose": [0, 1, 2, 4, 3]}]},
                       ((2, 2, 2, 4, 8),) * 3, ("float32",) * 3, {}, ("float32",), 17, ((),) * 3)
    other = LayerView("Attention", "", ok.attrs, ok.input_shapes, ok.input_dtypes, {}, ("float32",), 17, ())
    assert not any(AttentionTactic().supports(layer) for layer in (fp16, bool_mask, five_d, other))


@needs_bf16
@pytest.mark.parametrize("b,h,sq,sk,d,dv,dtype", [
    (1, 12, 128, 128, 64, 64, "float32"),    # BERT-base's heads
    (2, 3, 77, 77, 32, 32, "bfloat16"),
    (1, 2, 1, 77, 80, 80, "float32"),
    (2, 2, 33, 19, 17, 40, "bfloat16"),      # odd head size and odd key count: pairs padded with zeros
])
def test_bf16_math_matches_the_formula_on_bf16_operands(b, h, sq, sk, d, dv, dtype):
    """Q·Kᵀ and P·V on bf16 operands with FP32 accumulation: against the float64 formula on the same bf16-rounded
    Q, K, V, the other roundings are the softmax's cheaper exp (1.4e-4 relative) and P's to bf16 (2^-9 relative,
    its row sums kept FP32), so the output is within 2^-8 of its largest value; a bf16 output adds half an ulp."""
    layer = heads_layer(b, h, sq, sk, d, dv, mask_shape=(b, 1, 1, sk), dtypes=(dtype,) * 3, out=dtype)
    xs = inputs(layer, seed=9 + d)
    tactic = AttentionBf16Tactic()
    assert tactic.supports(layer) and tactic.reduced_precisions == {"BF16"}
    got = tactic.prepare(layer)(xs)[0]
    assert got.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    assert_matches(got, expected(layer, xs, round_bf16=True), 2 ** -8 + (2 ** -8 if dtype == "bfloat16" else 0))
    assert cosine(got.float(), expected(layer, xs)) > 0.9999


@needs_bf16
@pytest.mark.parametrize("nan_to_zero", [False, True])
def test_bf16_math_masked_rows(nan_to_zero):
    layer = heads_layer(1, 2, 4, 6, 16, mask_shape=(1, 1, 4, 6), nan_to_zero=nan_to_zero)
    xs = inputs(layer, seed=10, masked=[(0, 0, 2)])
    got = AttentionBf16Tactic().prepare(layer)(xs)[0]
    assert_matches(got, expected(layer, xs, round_bf16=True), 2 ** -8)
    assert bool((got[0, 2] == 0).all()) if nan_to_zero else bool(got[0, 2].isnan().all())


# ---- whole encoders built by kiln, against onnxruntime ------------------------------------------------------------
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.models import encoders

    model = encoders.make("bert", attn="sdpa")   # SDPA's export: the NaN guard fused into the Attention layer
    feeds = encoders.inputs(model, batch=2, seq=16)
    return encoders.export(model, feeds, tmp_path_factory.mktemp("bert") / "bert.onnx", "legacy"), feeds


def test_encoder_attention_runs_on_the_c_kernel_and_matches_onnxruntime(bert, tmp_path):
    proto, feeds = bert
    engine = kiln.build(proto, autotune=False)
    attention = [layer for layer in engine.plan.layers if layer.op_type == "Attention"]
    assert len(attention) == 2 and {layer.tactic_name for layer in attention} == {ATTENTION_TACTIC}
    got = engine.run(feeds)
    for out, want in zip(got.values(), run_ort(proto, feeds)):
        assert_close_to_ort(out, want)
    engine.save(tmp_path / "bert.kiln")
    for name, out in kiln.load(tmp_path / "bert.kiln").run(feeds).items():
        np.testing.assert_array_equal(out, got[name])


@needs_bf16
def test_bf16_encoder_attention_on_the_bf16_c_kernel(bert):
    proto, feeds = bert
    engine = kiln.build(proto, bf16=True, autotune=False, precision_constraints="prefer", accuracy="off")
    attention = [layer for layer in engine.plan.layers if layer.op_type == "Attention"]
    assert {(layer.tactic_name, layer.precision) for layer in attention} == {(ATTENTION_BF16_TACTIC, "BF16")}
    got, want = engine.run(feeds), run_ort(proto, feeds)
    assert cosine(next(iter(got.values())), want[0]) >= 0.999
    np.testing.assert_array_equal(np.isnan(next(iter(got.values()))), np.isnan(want[0]))
