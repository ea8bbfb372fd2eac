"""onnxruntime's transformer contrib ops (com.microsoft Attention, QAttention, MultiHeadAttention,
EmbedLayerNormalization, SkipLayerNormalization, SkipSimplifiedLayerNormalization, BiasGelu, FastGelu, Gelu, QuickGelu,
BiasAdd, FusedMatMul, MatMulNBits, RotaryEmbedding, QuantizeLinear, DequantizeLinear, and ai.onnx-domain
SimplifiedLayerNormalization), as onnxruntime's transformers optimizer, its quantizers and Optimum's O1-O3 write them,
and ONNX's own Attention, RotaryEmbedding (kiln.frontend.onnx_attention) and CastLike, unfolded at import into the
standard ops they stand for, as local functions are inlined. kiln's passes then fuse them again (attention, rotary,
skip-layer-norm, GELU epilogues, dynamic INT8 products, Q/DQ) onto its own kernels in every precision; TensorRT's
parser refuses these models. Each node made keeps the unfolded node as its origin (metadata UNFOLDED_KEY), so layer
info and `kiln inspect --by-onnx` still name it. What is not unfolded (onnxruntime's past/present state, packed mask
formats) is refused with the reason."""
from __future__ import annotations

import logging
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.frontend.onnx_attention import unfold_onnx_attention, unfold_onnx_rotary
from kiln.frontend.unfolder import UNFOLDED_KEY, Unfolder
from kiln.frontend.weight_only import dequantize_nbits, nbits_shape_error

log = logging.getLogger("kiln")
MS = "com.microsoft"
DEFAULT_EPSILON = {"SkipLayerNormalization": 1e-12, "SkipSimplifiedLayerNormalization": 1e-12,
                   "EmbedLayerNormalization": 1e-12, "SimplifiedLayerNormalization": 1e-5}


# ---- activations ------------------------------------------------------------------------------------------------
def _gelu(u: Unfolder) -> None:
    x = u.input(0)
    if u.src.op_type in ("BiasGelu", "FastGelu") and u.input(1):
        x = u.op("Add", [x, u.input(1)], "bias")
    approximate = "tanh" if u.src.op_type == "FastGelu" else "none"
    u.op("Gelu", [x], "gelu", u.output(0), approximate=approximate)


def _quick_gelu(u: Unfolder) -> None:
    x = u.input(0)
    scaled = u.op("Mul", [x, u.const("alpha", float(u.attrs.get("alpha", 1.702)))], "scale")
    u.op("Mul", [x, u.op("Sigmoid", [scaled], "sigmoid")], "gate", u.output(0))


def _standard_qdq(u: Unfolder) -> None:
    """com.microsoft QuantizeLinear/DequantizeLinear (what onnxruntime's quantizer writes for 4- and 16-bit types
    below opset 21): the standard op, which has the same inputs and `axis`."""
    u.op(u.src.op_type, list(u.src.input), "standard", u.output(0), **u.attrs)


def _cast_like(u: Unfolder) -> None:
    """CastLike (opset 15): a Cast to the element type of input 1, which shape inference knows."""
    target = u.type_of(u.input(1))
    if target is None:   # _known_ranks records known element types only
        u.refuse(f"the element type of its target '{u.input(1)}' is not known at import")
    attrs = {"saturate": u.attrs["saturate"]} if "saturate" in u.attrs else {}
    u.op("Cast", [u.input(0)], "cast", u.output(0), to=target[0], **attrs)


def _bias_add(u: Unfolder) -> None:
    u.op("Add", [u.op("Add", [u.input(0), u.input(1)], "bias"), u.input(2)], "skip", u.output(0))


def _fused_matmul(u: Unfolder) -> None:
    """FusedMatMul: alpha * op(A) @ op(B), op a transpose of the last two axes where transA/transB say."""
    if u.attrs.get("transBatchA", 0) or u.attrs.get("transBatchB", 0):
        u.refuse("transBatchA/transBatchB (a batch axis moved into the product) is not unfolded")
    operands = []
    for i, flag in ((0, "transA"), (1, "transB")):
        x = u.input(i)
        if u.attrs.get(flag, 0):
            rank = u.rank(x, f"input {i}")
            x = u.op("Transpose", [x], f"transpose{i}", perm=[*range(rank - 2), rank - 1, rank - 2])
        operands.append(x)
    alpha = float(u.attrs.get("alpha", 1.0))
    product = u.op("MatMul", operands, "matmul", None if alpha != 1.0 else u.output(0))
    if alpha != 1.0:
        u.op("Mul", [product, u.const("alpha", alpha)], "alpha", u.output(0))


def _matmul_nbits(u: Unfolder) -> None:
    """MatMulNBits (weight-only quantized A @ Bᵀ, B packed [N, blocks, bytes]): the weights dequantized once, at
    import, to FP32 [K, N], a MatMul, then the bias."""
    k, n, block = (int(u.attrs[a]) for a in ("K", "N", "block_size"))
    bits = int(u.attrs.get("bits", 4))
    if bits not in (2, 4, 8):
        u.refuse(f"bits={bits}: only 2, 4 and 8 bits are unpacked")
    if u.input(4):
        u.refuse("g_idx (act-order block indices) is not unfolded")
    packed, scales = u.constant(1, "packed weights"), u.constant(2, "scales")
    zero_points = u.constant(3, "zero points") if u.input(3) else None
    mismatch = nbits_shape_error(packed, scales, zero_points, k, n, bits, block)
    if mismatch:
        u.refuse(mismatch)
    w = dequantize_nbits(packed, scales, zero_points, k, n, bits, block)
    product = u.op("MatMul", [u.input(0), u.const("weight", w.T, w.dtype)], "matmul",
                   None if u.input(5) else u.output(0))
    if u.input(5):
        u.op("Add", [product, u.input(5)], "bias", u.output(0))


# ---- normalizations ---------------------------------------------------------------------------------------------
def _epsilon(u: Unfolder) -> float:
    return float(u.attrs.get("epsilon", DEFAULT_EPSILON[u.src.op_type]))


def _skip_layer_norm(u: Unfolder) -> None:
    """(input + bias) + skip, then LayerNormalization (or RMSNormalization for the simplified form) over the last
    axis; output 3 is the sum. The bias is added first: it is the preceding dense layer's, which MatMulAddFusion
    then takes back (onnxruntime's optimizer moved it here), leaving Add + LayerNorm for SkipLayerNormFusion."""
    rms = u.src.op_type == "SkipSimplifiedLayerNormalization"
    bias = u.input(3 if rms else 4)
    x = u.op("Add", [u.input(0), bias], "bias") if bias else u.input(0)
    total = u.op("Add", [x, u.input(1)], "skip", u.output(3))
    if rms:
        if u.output(1) or u.output(2):
            u.refuse("its mean and inv_std_var outputs (training outputs) are not unfolded")
        u.op("RMSNormalization", [total, u.input(2)], "norm", u.output(0), axis=-1, epsilon=_epsilon(u))
        return
    outs = [u.output(0) or f"{u.name}/norm:0", u.output(1) or "", u.output(2) or ""]
    while not outs[-1]:
        outs.pop()
    u.op("LayerNormalization", [total, u.input(2)] + ([u.input(3)] if u.input(3) else []), "norm", outs, axis=-1,
         epsilon=_epsilon(u))


def _simplified_layer_norm(u: Unfolder) -> None:
    if u.output(1):
        u.refuse("its inv_std_var output (a training output) is not unfolded")
    u.op("RMSNormalization", [u.input(0), u.input(1)], "norm", u.output(0), axis=int(u.attrs.get("axis", -1)),
         epsilon=_epsilon(u))


def _embed_layer_norm(u: Unfolder) -> None:
    """Gather the word, position and segment embeddings, add, LayerNormalization; the mask index is the count of
    set mask elements per row (zeros without a mask)."""
    ids, segments, words, positions, segment_table = (u.input(i) for i in range(5))
    total = u.op("Gather", [words, ids], "word", axis=0)
    position_ids = u.input(8) or u.seq_range(ids, 1, "position_ids")
    total = u.op("Add", [total, u.op("Gather", [positions, position_ids], "position", axis=0)], "add_position",
                 None if segments and segment_table else u.output(2))
    if segments and segment_table:
        total = u.op("Add", [total, u.op("Gather", [segment_table, segments], "segment", axis=0)], "add_segment",
                     u.output(2))
    u.op("LayerNormalization", [total, u.input(5), u.input(6)], "norm", u.output(0), axis=-1, epsilon=_epsilon(u))
    if u.output(1):
        if u.input(7):
            counted = u.op("Cast", [u.input(7)], "mask_int", to=TensorProto.INT32)
            u.op("ReduceSum", [counted, u.const("mask_axes", [1], np.int64)], "mask_index", u.output(1), keepdims=0)
        else:
            u.op("ConstantOfShape", [u.shape_part(ids, 0, 1, "batch")], "mask_index", u.output(1),
                 value=numpy_helper.from_array(np.zeros(1, np.int32)))


# ---- attention --------------------------------------------------------------------------------------------------
def _attention(u: Unfolder) -> None:
    """Merged Q/K/V projection, Split, heads, softmax(scale * Q Kᵀ + mask bias + attention_bias) V, heads merged:
    the form a BERT export has after kiln merges its projections, so AttentionFusion takes it whole."""
    _refuse_cache(u, ((4, "past state"), (6, "past_sequence_length")))
    sizes = _qkv_sizes(u)
    _attend_qkv(u, u.op("MatMul", [u.input(0), u.input(1)], "qkv"), sizes, u.input(3), u.input(5))


def _quantized_attention(u: Unfolder) -> None:
    """QAttention (quantize_dynamic's Attention; its input quantized by a DynamicQuantizeLinear): the projection as
    quantize_dynamic writes a MatMul, MatMulInteger -> Cast -> Mul(input_scale * weight_scale), which
    DynamicQuantizeMatMulFusion makes one INT8 layer; then as Attention."""
    _refuse_cache(u, ((8, "past state"),))
    sizes = _qkv_sizes(u)
    operands = [u.input(0), u.input(1), u.input(6) or "", u.input(7) or ""]
    while not operands[-1]:
        operands.pop()
    sums = u.op("Cast", [u.op("MatMulInteger", operands, "qkv_int32")], "qkv_float", to=TensorProto.FLOAT)
    qkv = u.op("Mul", [sums, u.op("Mul", [u.input(3), u.input(4)], "qkv_scales")], "qkv")
    _attend_qkv(u, qkv, sizes, u.input(5), None)


def _refuse_cache(u: Unfolder, past_inputs: tuple[tuple[int, str], ...]) -> None:
    for i, what in past_inputs:
        if u.input(i):
            u.refuse(f"its {what} input (an incremental decoder's KV cache) is not unfolded")
    if u.output(1):
        u.refuse("its present output (an incremental decoder's KV cache) is not unfolded")
    if u.attrs.get("do_rotary", 0) or u.attrs.get("past_present_share_buffer", 0):
        u.refuse("do_rotary / past_present_share_buffer are not unfolded")


def _qkv_sizes(u: Unfolder) -> list[int]:
    heads = int(u.attrs["num_heads"])
    sizes = [int(s) for s in u.attrs.get("qkv_hidden_sizes", [])]
    if not sizes:
        width = _weight_width(u)
        sizes = [width // 3] * 3
    if sizes[0] != sizes[1] or any(s % heads for s in sizes):
        u.refuse(f"qkv_hidden_sizes {sizes}: Q and K widths must match and each be a multiple of num_heads {heads}")
    return sizes


def _attend_qkv(u: Unfolder, qkv: str, sizes: list[int], mask: str | None, attention_bias: str | None) -> None:
    """Attention from the merged projection `qkv` [B,S,Dq+Dk+Dv] (its bias, input 2, added here)."""
    heads = int(u.attrs["num_heads"])
    if u.input(2):
        qkv = u.op("Add", [qkv, u.input(2)], "qkv_bias")
    u.op("Split", [qkv, u.const("split", sizes, np.int64)], "split", [f"{u.name}/{p}:0" for p in "qkv"], axis=-1)
    q, k, v = (u.split_heads(f"{u.name}/{p}:0", p, heads, s // heads, keys_transposed=p == "k")
               for p, s in zip("qkv", sizes))
    scale = float(u.attrs.get("scale", 1.0 / math.sqrt(sizes[0] // heads)))
    _attend(u, q, k, v, scale, _mask_bias(u, mask, u.input(0)), attention_bias)


def _attend(u: Unfolder, q: str, k: str, v: str, scale: float | str, mask_bias: str | None,
            attention_bias: str | None) -> None:
    """softmax(scale * Q Kᵀ + mask bias + attention_bias) V from heads Q [B,N,S,h], Kᵀ [B,N,h,L], V [B,N,L,hv],
    heads merged into output 0 [B,S,N*hv]."""
    scale = u.const("scale", scale) if isinstance(scale, float) else scale
    scores = u.op("Mul", [u.op("MatMul", [q, k], "scores"), scale], "scaled")
    for bias, tag in ((mask_bias, "mask_add"), (attention_bias, "attention_bias_add")):
        if bias:
            scores = u.op("Add", [scores, bias], tag)
    probs = u.op("Softmax", [scores], "softmax", axis=-1)
    u.merge_heads(u.op("MatMul", [probs, v], "context"), u.output(0))


def _weight_width(u: Unfolder) -> int:
    width = u.weight_width(1)
    if width is None or width % 3:
        u.refuse("without qkv_hidden_sizes its weights must be a constant whose width divides by three")
    return width


def _mask_bias(u: Unfolder, mask: str | None, keys: str) -> str | None:
    """The additive bias onnxruntime derives from a mask index (0 where attended, mask_filter_value where not) and
    from unidirectional, shaped to broadcast over [batch, heads, sequence, total]; `keys` is a [B, L, ...] tensor
    of the attended sequence."""
    filler = u.const("filter", float(u.attrs.get("mask_filter_value", -10000.0)))
    zero = u.const("zero", 0.0)
    bias = _padding_bias(u, mask, keys, filler, zero) if mask else None
    if u.attrs.get("unidirectional", 0):
        positions = u.seq_range(keys, 1, "causal_positions")
        later = u.op("Greater", [u.unsqueeze(positions, [0], "causal_row"),
                                 u.unsqueeze(positions, [1], "causal_column")], "later")
        causal = u.op("Where", [later, filler, zero], "causal")
        bias = causal if bias is None else u.op("Add", [bias, causal], "mask_causal")
    return bias


def _padding_bias(u: Unfolder, mask: str, keys: str, filler: str, zero: str) -> str:
    rank = u.rank(mask, "mask_index")
    key = ("mask bias", mask, float(u.attrs.get("mask_filter_value", -10000.0)))
    if rank in (2, 3) and key in u.shared:   # every layer of a BERT reads the same raw mask: one bias for all
        return u.shared[key]
    if rank == 1:   # right padding: each row's key length
        positions = u.unsqueeze(u.seq_range(keys, 1, "key_positions"), [0], "key_row")
        lengths = u.unsqueeze(u.op("Cast", [mask], "lengths", to=TensorProto.INT64), [1], "length_column")
        attended = u.op("Less", [positions, lengths], "attended")
    elif rank in (2, 3):   # raw mask: [batch, total] or [batch, sequence, total]
        attended = u.op("Greater", [u.op("Cast", [mask], "mask_float", to=TensorProto.FLOAT), zero], "attended")
    else:
        u.refuse("a 4-D (Megatron) mask_index is not unfolded")
    bias = u.unsqueeze(u.op("Where", [attended, zero, filler], "mask_bias"), [1, 2] if rank in (1, 2) else [1],
                       "mask")
    if rank in (2, 3):
        u.shared[key] = bias
    return bias


def _multi_head_attention(u: Unfolder) -> None:
    """MultiHeadAttention on projected Q [B,S,D], K [B,L,D], V [B,L,Dv] (self- or cross-attention), their
    optional bias [D+D+Dv] added first, then as Attention does; sizes are read from the shapes (folded at build)."""
    for i, what in ((6, "past_key"), (7, "past_value"), (8, "past_sequence_length"), (9, "cache_indirection")):
        if u.input(i):
            u.refuse(f"its {what} input (an incremental decoder's KV cache) is not unfolded")
    if u.output(1) or u.output(2) or u.output(3):
        u.refuse("its present_key/present_value/qk outputs are not unfolded")
    query, key, value = u.input(0), u.input(1), u.input(2)
    if not (key and value) or any(u.rank(x, what) != 3 for x, what in ((query, "query"), (key, "key"),
                                                                      (value, "value"))):
        u.refuse("only 3-D query, key and value are unfolded (not packed QKV/KV or 4-D BNSH key/value)")
    heads = int(u.attrs["num_heads"])
    widths = [u.shape_part(x, 2, 3, f"{p}_width") for p, x in zip("qv", (query, value))]
    if u.input(3):
        sizes = u.op("Concat", [widths[0], widths[0], widths[1]], "bias_sizes", axis=0)
        u.op("Split", [u.input(3), sizes], "bias_split", [f"{u.name}/{p}_bias:0" for p in "qkv"], axis=0)
        query, key, value = (u.op("Add", [x, f"{u.name}/{p}_bias:0"], f"{p}_add_bias")
                             for p, x in zip("qkv", (query, key, value)))
    q, k, v = (u.split_heads(x, p, heads, keys_transposed=p == "k") for p, x in zip("qkv", (query, key, value)))
    if "scale" in u.attrs:
        scale = float(u.attrs["scale"])
    else:   # 1 / sqrt(D / num_heads)
        head = u.op("Div", [u.op("Cast", [widths[0]], "width_float", to=TensorProto.FLOAT),
                            u.const("num_heads", [float(heads)])], "head_size")
        scale = u.inverse_sqrt(head, "scale")
    _attend(u, q, k, v, scale, _mask_bias(u, u.input(4), key), u.input(5))


UNFOLDINGS = {
    (MS, "Gelu"): _gelu, (MS, "BiasGelu"): _gelu, (MS, "FastGelu"): _gelu, (MS, "QuickGelu"): _quick_gelu,
    (MS, "BiasAdd"): _bias_add, (MS, "FusedMatMul"): _fused_matmul, (MS, "MatMulNBits"): _matmul_nbits,
    (MS, "SkipLayerNormalization"): _skip_layer_norm, (MS, "SkipSimplifiedLayerNormalization"): _skip_layer_norm,
    ("", "SimplifiedLayerNormalization"): _simplified_layer_norm, (MS, "SimplifiedLayerNormalization"):
        _simplified_layer_norm,
    (MS, "EmbedLayerNormalization"): _embed_layer_norm, (MS, "Attention"): _attention,
    (MS, "QAttention"): _quantized_attention, (MS, "MultiHeadAttention"): _multi_head_attention,
    (MS, "QuantizeLinear"): _standard_qdq, (MS, "DequantizeLinear"): _standard_qdq,
    ("", "CastLike"): _cast_like, ("", "Attention"): unfold_onnx_attention, ("", "RotaryEmbedding"): unfold_onnx_rotary,
    (MS, "RotaryEmbedding"): unfold_onnx_rotary,
}


STANDARD_UNFOLDED = frozenset(op for domain, op in UNFOLDINGS if domain == "")   # ai.onnx ops kiln unfolds


def _unfolding(node: onnx.NodeProto):
    return UNFOLDINGS.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))


def unfold_contrib_ops(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with every contrib node of UNFOLDINGS replaced by standard nodes (a copy; `proto` is kept)."""
    graph = proto.graph
    if not any(_unfolding(n) for n in graph.node):
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    if not any(imp.domain == MS for imp in out.opset_import):   # the optimizer's in-memory model lacks it
        out.opset_import.append(helper.make_opsetid(MS, 1))
    declared: dict[str, int] = {}   # the ranks of the contrib nodes' outputs, for inference past them
    types: dict[str, tuple[int, tuple | None]] = {}   # element type and dims (int, dim_param or None) if inferred
    ranks = _known_ranks(out, out.graph.node, declared, types)
    weights = {t.name: t for t in out.graph.initializer}
    nodes, counts, shared, prefixes = [], {}, {}, set()
    opsets = {imp.domain or "": imp.version for imp in out.opset_import}
    for i, node in enumerate(out.graph.node):
        unfold = _unfolding(node)
        if unfold is None:
            nodes.append(node)
            continue
        # a value after an earlier contrib node has no inferred rank until that node is unfolded
        u = Unfolder(node, ranks=ranks, types=types, shared=shared, weights=weights,
                     infer=lambda: _known_ranks(out, nodes + list(out.graph.node[i:]), declared, types),
                     opset=opsets.get("" if node.domain == "ai.onnx" else node.domain, 1),
                     prefix=_prefix(node, i, prefixes))
        unfold(u)
        if unfold is not _standard_qdq and any(x not in ranks for x in node.input[:2] if x):
            ranks.update(u.infer())   # (a Q/DQ needs no rank: inferring after each of thousands is quadratic)
        declared.update(_output_ranks(node, ranks))
        ranks.update(declared)
        nodes += u.nodes
        out.graph.initializer.extend(u.consts)
        key = (MS if node.domain == MS else "", node.op_type)
        counts[key] = counts.get(key, 0) + 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for (domain, op_type), count in sorted(counts.items()):
        source = "onnxruntime" if domain == MS else "ONNX"
        log.info("ContribUnfolding: %d %s %s node(s) unfolded into standard ops", count, source, op_type)
    return out


def _prefix(node: onnx.NodeProto, index: int, taken: set[str]) -> str:
    """The prefix of the names an unfolded node makes: its name, or with its index where ONNX names repeat."""
    prefix = node.name or f"{node.op_type}_{node.output[0]}"
    prefix = f"{prefix}_{index}" if prefix in taken else prefix
    taken.add(prefix)
    return prefix


def _known_ranks(proto: onnx.ModelProto, nodes, declared: dict[str, int],
                 types: dict[str, tuple[int, tuple | None]] | None = None) -> dict[str, int]:
    """Ranks of the values whose type the model with `nodes` declares (inputs, outputs, value_info, initializers,
    the `declared` outputs of contrib nodes already unfolded, and what ONNX shape inference finds from them) and
    EmbedLayerNormalization's 1-D mask index. Inference reads a skeleton of the model: large weights as typed
    inputs. `types` gets each typed value's element type and dims."""
    ranks: dict[str, int] = {}
    types = {} if types is None else types
    try:
        inferred = onnx.shape_inference.infer_shapes(_skeleton(proto, nodes, declared), strict_mode=False)
    except Exception:   # a malformed model fails later, with kiln's own message
        inferred = proto
    for info in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        tensor = info.type.tensor_type
        dims = None
        if tensor.HasField("shape"):
            ranks[info.name] = len(tensor.shape.dim)
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor.shape.dim)
        if tensor.elem_type:
            types[info.name] = (tensor.elem_type, dims)
    for init in proto.graph.initializer:
        ranks[init.name] = len(init.dims)
        types[init.name] = (init.data_type, tuple(init.dims))
    for node in nodes:
        if node.op_type == "EmbedLayerNormalization" and len(node.output) > 1 and node.output[1]:
            ranks[node.output[1]] = 1
    return ranks


def _output_ranks(node: onnx.NodeProto, ranks: dict[str, int]) -> dict[str, int]:
    """The ranks of a contrib node's outputs: [B,S,D] for attention and embeddings, the first input's otherwise."""
    if node.op_type == "Attention" and node.domain != MS:   # ONNX's: Q's rank; present K/V and scores 4-D
        return {name: 4 if i else ranks.get(node.input[0], 4) for i, name in enumerate(node.output) if name}
    if node.op_type in ("Attention", "QAttention", "MultiHeadAttention"):
        return {node.output[0]: 3}
    if node.op_type == "EmbedLayerNormalization":
        return {name: 1 if i == 1 else 3 for i, name in enumerate(node.output) if name}
    if node.op_type == "FusedMatMul":
        known = [ranks[x] for x in node.input[:2] if x in ranks]
        return {node.output[0]: max(known)} if len(known) == 2 else {}
    rank = ranks.get(node.input[0])
    return {} if rank is None else {name: rank for name in node.output if name}


SKELETON_BYTES = 1024   # initializers up to this size keep their values (shape constants); larger ones become inputs


def _skeleton(proto: onnx.ModelProto, nodes, declared: dict[str, int]) -> onnx.ModelProto:
    g = proto.graph
    small = [t for t in g.initializer if np.prod(t.dims, dtype=np.int64) * 8 <= SKELETON_BYTES]
    inputs = {v.name for v in g.input}
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer
               if t.name not in inputs and np.prod(t.dims, dtype=np.int64) * 8 > SKELETON_BYTES]
    known = {v.name for v in g.value_info}
    typed = [*g.value_info, *(helper.make_tensor_value_info(name, TensorProto.FLOAT, [None] * rank)
                              for name, rank in declared.items() if name not in known)]
    graph = helper.make_graph(list(nodes), g.name, [*g.input, *weights], list(g.output), small, value_info=typed)
    model = helper.make_model(graph, opset_imports=proto.opset_import)
    model.ir_version = proto.ir_version
    return model
