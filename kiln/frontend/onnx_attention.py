"""ONNX's Attention (opset 23-25) and RotaryEmbedding (opset 23; also onnxruntime's com.microsoft RotaryEmbedding),
unfolded at import into the standard ops they stand for, in the form kiln's AttentionFusion and RotaryFusion take
whole: heads split, Q·Kᵀ, scale, the bias of the mask, causal and window rules, softmax (fully masked rows 0,
as the spec says), ·V, heads merged; K/V heads repeated for grouped-query attention as HF's repeat_kv writes it;
past K/V concatenated into the present outputs. torch.onnx's exporter writes these for scaled_dot_product_attention
and RMSNorm at opset 23; TensorRT's parser refuses them before 10.x."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kiln.frontend.unfolder import Unfolder

BOOL, FLOAT = TensorProto.BOOL, TensorProto.FLOAT
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


# ---- Attention --------------------------------------------------------------------------------------------------
def unfold_onnx_attention(u: Unfolder) -> None:
    """softmax(scale · Q Kᵀ [softcap] + bias) V on BNSH heads (3-D inputs split into heads first)."""
    if bool(u.input(4)) != bool(u.input(5)):
        u.refuse("past_key and past_value must be given together")
    if u.input(6) and u.input(4):
        u.refuse("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    rank = u.rank(u.input(0), "Q")
    if rank not in (3, 4):
        u.refuse(f"Q is {rank}-D; ONNX Attention takes 3-D [B,S,hidden] or 4-D [B,N,S,h]")
    q, k, v = (_bnsh(u, u.input(i), p, rank) for i, p in enumerate("qkv"))
    q_heads, kv_heads = _head_counts(u, rank)
    if u.input(4):
        k = u.op("Concat", [u.input(4), k], "present_key", axis=2)
        v = u.op("Concat", [u.input(5), v], "present_value", axis=2)
    for i, x in ((1, k), (2, v)):
        if u.output(i):
            u.op("Identity", [x], f"present_{'kv'[i - 1]}_out", u.output(i))
    group = _group(u, q, k, q_heads, kv_heads)
    if group:
        k, v = _repeat_kv(u, k, "k", *group), _repeat_kv(u, v, "v", *group)
    scores = u.op("Mul", [u.op("MatMul", [q, u.op("Transpose", [k], "k_transposed", perm=[0, 1, 3, 2])], "scores"),
                          _scale(u, q, rank)], "scaled")
    stages = {0: scores}
    if u.attrs.get("softcap", 0.0) > 0:   # mode 0 reads the scores before it (the spec; onnx's reference after)
        cap = float(u.attrs["softcap"])
        capped = u.op("Tanh", [u.op("Mul", [scores, u.const("inv_softcap", 1.0 / cap)], "softcap_in")], "softcap_tanh")
        scores = u.op("Mul", [capped, u.const("softcap", cap)], "softcap")
    stages[1] = scores
    bias = _bias(u, q, k)
    if bias:
        scores = u.op("Add", [scores, bias], "bias_add")
    stages[2] = scores
    probs = u.op("Softmax", [scores], "softmax", axis=-1)
    if bias:   # a row masked throughout gives 0, as the spec says (a softmax over -inf alone is NaN)
        probs = u.op("Where", [u.op("IsNaN", [probs], "masked_row"), u.const("zero", 0.0), probs], "masked_zero")
    stages[3] = probs
    if u.output(3):
        mode = int(u.attrs.get("qk_matmul_output_mode", 0))
        if mode not in stages:
            u.refuse(f"qk_matmul_output_mode {mode} is not one of 0-3")
        u.op("Identity", [stages[mode]], "qk_out", u.output(3))
    out = u.op("MatMul", [probs, v], "context", u.output(0) if rank == 4 else None)
    if rank == 4:
        return
    u.merge_heads(out, u.output(0))


def _bnsh(u: Unfolder, x: str, part: str, rank: int) -> str:
    """A 3-D [B,S,N*h] input as BNSH heads (q_num_heads / kv_num_heads); a 4-D one as it is."""
    if rank == 4:
        if u.rank(x, part.upper()) != 4:
            u.refuse(f"Q is 4-D but {part.upper()} is not")
        return x
    if u.rank(x, part.upper()) != 3:
        u.refuse(f"Q is 3-D but {part.upper()} is not")
    heads = int(u.attrs.get("q_num_heads" if part == "q" else "kv_num_heads", 0))
    if heads <= 0:
        u.refuse("3-D Q, K and V need the q_num_heads and kv_num_heads attributes")
    return u.split_heads(x, part, heads)


def _head_counts(u: Unfolder, rank: int) -> tuple:
    """(Q heads, K/V heads): the attributes for 3-D inputs, else axis 1 of Q and K where inference knows it."""
    if rank == 3:
        return int(u.attrs["q_num_heads"]), int(u.attrs["kv_num_heads"])
    return _dim(u, u.input(0), 1), _dim(u, u.input(1), 1)


def _dim(u: Unfolder, x: str, axis: int):
    """Axis `axis` of input `x` (int, dim_param or None) where shape inference knows it."""
    found = u.type_of(x)
    return None if found is None or found[1] is None or len(found[1]) <= axis else found[1][axis]


def _group(u: Unfolder, q: str, k: str, q_heads, kv_heads) -> tuple[str, str] | None:
    """For grouped-query attention, (Expand's [1, 1, group, 1, 1], the Q head count [1]); None where the counts are
    known equal. Constants where inference knows the counts, else computed from the shapes at build time."""
    if q_heads is not None and q_heads == kv_heads:
        return None
    if isinstance(q_heads, int) and isinstance(kv_heads, int):
        if q_heads % kv_heads:
            u.refuse(f"q heads {q_heads} are not a multiple of the kv heads {kv_heads}")
        return (u.const("group", [1, 1, q_heads // kv_heads, 1, 1], np.int64),
                u.const("q_head_count", [q_heads], np.int64))
    q_count, kv_count = u.shape_part(q, 1, 2, "q_head_count"), u.shape_part(k, 1, 2, "kv_head_count")
    ones = u.const("ones", [1, 1], np.int64)
    group = u.op("Concat", [ones, u.op("Div", [q_count, kv_count], "group_size"), ones], "group", axis=0)
    return group, q_count


def _repeat_kv(u: Unfolder, x: str, tag: str, group: str, heads: str) -> str:
    """K or V heads repeated for grouped-query attention (query head i reads K/V head i // group), as HF's
    repeat_kv writes it: Unsqueeze, Expand, Reshape."""
    expanded = u.op("Expand", [u.unsqueeze(x, [2], f"{tag}_grouped"), group], f"{tag}_expanded")
    shape = u.op("Concat", [u.shape_part(x, 0, 1, f"{tag}_batch"), heads, u.shape_part(x, 2, 4, f"{tag}_sd")],
                 f"{tag}_repeated_shape", axis=0)
    return u.op("Reshape", [expanded, shape], f"{tag}_repeated")


def _scale(u: Unfolder, q: str, rank: int) -> str:
    """The scale attribute, else 1/sqrt(head size): a constant where inference knows it, else from Q's shape."""
    if "scale" in u.attrs:
        return u.const("scale", float(u.attrs["scale"]))
    width = _dim(u, u.input(0), rank - 1)
    if isinstance(width, int) and width > 0:
        return u.const("scale", 1.0 / float(np.sqrt(width // (int(u.attrs["q_num_heads"]) if rank == 3 else 1))))
    return u.inverse_sqrt(u.op("Cast", [u.shape_part(q, 3, 4, "head_size")], "head_float", to=FLOAT), "scale")


def _bias(u: Unfolder, q: str, k: str) -> str | None:
    """The additive bias over [B,N,Sq,total]: the mask (a boolean one as 0 / -inf, padded with -inf to the total
    keys), plus -inf where the causal rule, the windows or nonpad_kv_seqlen rule a key out."""
    biases = []
    if u.input(3):
        biases.append(_mask_bias(u, u.input(3), k))
    rules = _position_rules(u, q, k)
    if rules:
        biases.append(rules)
    total = biases[0] if biases else None
    for extra in biases[1:]:
        total = u.op("Add", [total, extra], "bias")
    return total


def _mask_bias(u: Unfolder, mask: str, k: str) -> str:
    found = u.type_of(mask)
    if found is None:
        u.refuse(f"the element type of its attn_mask '{mask}' is not known at import")
    elem, dims = found
    if elem == BOOL:
        mask = u.op("Where", [mask, u.const("mask_zero", 0.0), u.const("mask_minus_inf", -np.inf)], "mask_bias")
    elif elem not in FLOATS:
        u.refuse(f"its attn_mask '{mask}' is {TensorProto.DataType.Name(elem)}; it takes bool or floating point")
    if dims and dims[-1] is not None and dims[-1] == _key_count(u):
        return mask   # as long as the keys: no padding
    total = u.shape_part(k, 2, 3, "total_keys")
    short = u.op("Sub", [total, u.shape_part(mask, -1, np.iinfo(np.int64).max, "mask_keys")], "mask_short")
    zeros = u.const("pad_zeros", [0] * (2 * u.rank(u.input(3), "attn_mask") - 1), np.int64)
    pads = u.op("Concat", [zeros, short], "mask_pads", axis=0)
    return u.op("Pad", [mask, pads, u.const("pad_value", -np.inf)], "mask_padded", mode="constant")


def _key_count(u: Unfolder):
    """past + new keys where inference knows both (int or, without a past, a dim_param), else None."""
    keys = _dim(u, u.input(1), 2 if u.rank(u.input(1), "K") == 4 else 1)
    if not u.input(4):
        return keys
    past = _dim(u, u.input(4), 2)
    return past + keys if isinstance(past, int) and isinstance(keys, int) else None


def _query_positions(u: Unfolder, q: str, lengths: str | None) -> str:
    """i + offset per query: [Sq, 1], offset by the past length, or [B, Sq, 1] by nonpad_kv_seqlen - Sq."""
    rows = u.unsqueeze(u.seq_range(q, 2, "query_positions"), [1], "query_column")
    if u.input(4):
        past = u.op("Squeeze", [u.shape_part(u.input(4), 2, 3, "past_length")], "past")
        return u.op("Add", [rows, past], "query_absolute")
    if lengths is None:
        return rows
    offsets = u.op("Sub", [lengths, u.op("Squeeze", [u.shape_part(q, 2, 3, "query_count")], "query_n")],
                   "nonpad_offsets")
    return u.op("Add", [rows, u.unsqueeze(offsets, [1, 2], "offset_column")], "query_absolute")


def _position_rules(u: Unfolder, q: str, k: str) -> str | None:
    """-inf where key j is past query i's causal frontier (j > i + offset) or outside its windows (i + offset - j
    over left_window_size or under -right_window_size), or at or past nonpad_kv_seqlen; offset is the past length,
    nonpad_kv_seqlen - Sq per batch, or 0."""
    causal = int(u.attrs.get("is_causal", 0))
    left, right = int(u.attrs.get("left_window_size", -1)), int(u.attrs.get("right_window_size", -1))
    nonpad = u.input(6)
    if not (causal or left >= 0 or right >= 0 or nonpad):
        return None
    cols = u.unsqueeze(u.seq_range(k, 2, "key_positions"), [0], "key_row")           # [1, total]
    lengths = u.op("Cast", [nonpad], "nonpad_lengths", to=TensorProto.INT64) if nonpad else None
    allowed = []
    if causal or left >= 0 or right >= 0:
        diff = u.op("Sub", [_query_positions(u, q, lengths), cols], "distance")   # i + offset - j
    if causal:
        allowed.append(u.op("GreaterOrEqual", [diff, u.const("zero_i", 0, np.int64)], "causal_ok"))
    if left >= 0:
        allowed.append(u.op("LessOrEqual", [diff, u.const("left", left, np.int64)], "left_ok"))
    if right >= 0:
        allowed.append(u.op("GreaterOrEqual", [diff, u.const("right", -right, np.int64)], "right_ok"))
    if nonpad:
        allowed.append(u.op("Less", [cols, u.unsqueeze(lengths, [1, 2], "nonpad_column")], "nonpad_ok"))
    ok = allowed[0]
    for n, extra in enumerate(allowed[1:]):
        ok = u.op("And", [ok, extra], f"allowed_{n}")
    bias = u.op("Where", [ok, u.const("rule_zero", 0.0), u.const("rule_minus_inf", -np.inf)], "rule_bias")
    return u.unsqueeze(bias, [1], "rule_heads") if nonpad else bias


# ---- RotaryEmbedding --------------------------------------------------------------------------------------------
def unfold_onnx_rotary(u: Unfolder) -> None:
    """x·cos + rotate(x)·sin on the first rotary_embedding_dim features of each head, the rest passed through:
    halves (rotate_half, as RotaryFusion takes it) or interleaved pairs. ONNX's op reads inputs (X, cos_cache,
    sin_cache, position_ids) and 4-D X as BNSH; onnxruntime's (X, position_ids, cos_cache, sin_cache)."""
    ms = u.src.domain == "com.microsoft"
    x, cos, sin, positions = (u.input(i) for i in ((0, 2, 3, 1) if ms else (0, 1, 2, 3)))
    if ms and (int(u.attrs.get("is_packed_batching", 0)) or float(u.attrs.get("scale", 1.0)) != 1.0):
        u.refuse("is_packed_batching and a scale other than 1 are not unfolded")
    rank = u.rank(x, "input")
    if rank not in (3, 4):
        u.refuse(f"its input is {rank}-D; it takes 3-D [B,S,hidden] or 4-D [B,N,S,h]")
    half = _half_width(u, cos)
    rotary, head = 2 * half, _head_size(u, x, rank, ms, half)
    if rank == 3:   # [B, S, N, h]; onnxruntime's num_heads 0 means heads of the rotary width
        heads = int(u.attrs.get("num_heads", 0))
        x = u.op("Reshape", [x, u.const("heads", [0, 0, heads, -1] if heads > 0 else [0, 0, -1, rotary], np.int64)],
                 "bsnh")
    positions = _positions(u, positions, ms, x, 1 if rank == 3 else 2)
    cos, sin = (u.op("Gather", [t, positions], f"{tag}_gathered", axis=0) if positions else t
                for t, tag in ((cos, "cos"), (sin, "sin")))   # [B, S, rotary/2]
    cos, sin = (u.unsqueeze(t, [2 if rank == 3 else 1], f"{tag}_heads") for t, tag in ((cos, "cos"), (sin, "sin")))
    whole = not u.attrs.get("rotary_embedding_dim") or head == rotary
    part = x if whole else _slice(u, x, 0, rotary, "rotated_part")
    if int(u.attrs.get("interleaved", 0)):
        turned = _interleaved(u, part, cos, sin, half)
    else:
        cos, sin = (u.op("Concat", [t, t], f"{tag}_full", axis=-1) for t, tag in ((cos, "cos"), (sin, "sin")))
        rotated = u.op("Concat", [u.op("Neg", [_slice(u, part, half, rotary, "x2")], "minus_x2"),
                                  _slice(u, part, 0, half, "x1")], "rotate_half", axis=-1)
        turned = u.op("Add", [u.op("Mul", [part, cos], "x_cos"), u.op("Mul", [rotated, sin], "rotated_sin")],
                      "rotary")
    if not whole:
        turned = u.op("Concat", [turned, _slice(u, x, rotary, np.iinfo(np.int64).max, "passed")], "joined", axis=-1)
    if rank == 3:
        turned = u.op("Reshape", [turned, u.op("Shape", [u.input(0)], "shape")], "merged")
    u.op("Identity", [turned], "out", u.output(0))


def _positions(u: Unfolder, positions: str | None, ms: bool, x: str, seq_axis: int) -> str | None:
    """The positions the caches are gathered at: position_ids, or for onnxruntime's 0-D/1-element form a start
    position, meaning start + 0..S-1; None without them (ONNX's caches then come per token already)."""
    if positions is None or not (ms and u.rank(positions, "position_ids") in (0, 1)):
        return positions
    start = u.op("Reshape", [u.op("Cast", [positions], "start_int", to=TensorProto.INT64),
                             u.const("one", [1], np.int64)], "start")
    steps = u.seq_range(x, seq_axis, "steps")
    return u.unsqueeze(u.op("Add", [steps, start], "positions"), [0], "position_row")


def _half_width(u: Unfolder, cos_cache: str) -> int:
    """rotary/2: the cos cache's last axis (the spec ties them), else rotary_embedding_dim / 2."""
    found = u.type_of(cos_cache)
    width = None if found is None or not found[1] else found[1][-1]
    if not isinstance(width, int):
        width = int(u.attrs.get("rotary_embedding_dim", 0)) // 2 or None
    if not width:
        u.refuse(f"the width of its cos cache '{cos_cache}' is not known at import; give rotary_embedding_dim")
    return width


def _head_size(u: Unfolder, x: str, rank: int, ms: bool, half: int) -> int | None:
    """The head size where inference knows it: 4-D X's last axis; for 3-D X, hidden / num_heads (onnxruntime's
    num_heads 0, without rotary_embedding_dim: the rotary width)."""
    width = _dim(u, x, rank - 1)
    heads = int(u.attrs.get("num_heads", 0))
    if rank == 3 and heads <= 0:
        if not ms or u.attrs.get("rotary_embedding_dim"):
            u.refuse("a 3-D input needs the num_heads attribute")
        return 2 * half
    if not isinstance(width, int):
        return None
    return width if rank == 4 else width // heads


def _slice(u: Unfolder, x: str, start: int, end: int, tag: str, step: int = 1) -> str:
    return u.op("Slice", [x, u.const(f"{tag}_start", [start], np.int64), u.const(f"{tag}_end", [end], np.int64),
                          u.const(f"{tag}_axis", [-1], np.int64), u.const(f"{tag}_step", [step], np.int64)], tag)


def _interleaved(u: Unfolder, part: str, cos: str, sin: str, half: int) -> str:
    """GPT-J's pairs: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), written back in pairs."""
    even, odd = _slice(u, part, 0, 2 * half, "even", 2), _slice(u, part, 1, 2 * half, "odd", 2)
    real = u.op("Sub", [u.op("Mul", [even, cos], "even_cos"), u.op("Mul", [odd, sin], "odd_sin")], "real")
    imag = u.op("Add", [u.op("Mul", [even, sin], "even_sin"), u.op("Mul", [odd, cos], "odd_cos")], "imag")
    pairs = u.op("Concat", [u.unsqueeze(real, [-1], "real_pair"), u.unsqueeze(imag, [-1], "imag_pair")], "pairs",
                 axis=-1)
    return u.op("Reshape", [pairs, u.op("Shape", [part], "part_shape")], "interleaved")
