"""kiln's own layer ops (domain "kiln"): Shuffle (reshape/transpose steps), PointWise (fused programs),
Attention (softmax(Q·Kᵀ·scale + mask)·V with the data movement around it), SkipLayerNormalization,
RotaryEmbedding, and the INT8 layers (QConv, QMatMul, QGemm, QAdd, QSoftmax, QLayerNorm, QConcat, QAveragePool,
QResize from Q/DQ; DynamicQMatMul, DynamicQConv from dynamic quantization)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.registry import KILN_OPS, OPS, OpDef, OpKind


def apply_steps(x: torch.Tensor, steps: list[dict]) -> torch.Tensor:
    """Data-movement steps: {"transpose": perm}, {"reshape": target} (ONNX semantics: 0 copies the input's
    axis, -1 is inferred) and {"slice": [axis, start, end]}."""
    for step in steps:
        if "transpose" in step:
            x = x.permute(*step["transpose"])
        elif "reshape" in step:
            x = x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(step["reshape"])])
        else:
            axis, start, end = step["slice"]
            x = x.narrow(axis, start, end - start)
    return x


def shuffle(attrs, xs):
    return [apply_steps(xs[0], attrs["steps"])]


def attention(attrs, xs):
    """Inputs q, kᵀ, v (after their steps: [..., Sq, D], [..., D, Sk], [..., Sk, D]) and an optional additive
    mask broadcastable to [..., Sq, Sk]; `scale` multiplies Q·Kᵀ before the mask is added."""
    q = apply_steps(xs[0], attrs.get("q_steps", []))
    k = apply_steps(xs[1], attrs.get("k_steps", [])).transpose(-1, -2)
    v = apply_steps(xs[2], attrs.get("v_steps", []))
    mask = xs[3] if len(xs) > 3 else None
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=float(attrs["scale"]))
    if attrs.get("nan_to_zero"):   # rows whose every key is masked with -inf
        out = torch.where(out.isnan(), 0.0, out)
    return [apply_steps(out, attrs.get("out_steps", []))]


def skip_layer_norm(attrs, xs):
    """LayerNormalization(x + skip) over the trailing axes from `axis` (inputs x, skip, scale, bias)."""
    x = xs[0] + xs[1]
    axis = attrs.get("axis", -1) % x.dim()
    return [F.layer_norm(x, x.shape[axis:], xs[2], xs[3] if len(xs) > 3 else None, attrs.get("epsilon", 1e-5))]


def rotary_embedding(attrs, xs):
    """x * cos + rotate_half(x) * sin along the last axis, rotate_half(x) = [-x[..., D/2:], x[..., :D/2]] (the
    half-split rotary embedding, kiln.passes.rotary); cos and sin D wide, broadcast to x."""
    x, cos, sin = xs
    half = x.shape[-1] // 2
    return [x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin]


def run_program(steps, xs):
    """Evaluate a PointWise program; args are "x<i>" (layer input), "t<k>" (step k) or {"const": value}."""
    temps: list[torch.Tensor] = []
    for step in steps:
        args = []
        for a in step["args"]:
            if a is None or isinstance(a, dict):
                args.append(None if a is None else a["const"])
            elif a[0] == "x":
                args.append(xs[int(a[1:])])
            else:
                args.append(temps[int(a[1:])])
        temps.append(OPS[step["op"]].impl(step["attrs"], args)[0])
    return temps[-1]


def program_on_bytes(program, inputs: list, index: int, signed: bool) -> torch.Tensor:
    """A PointWise program's output for each byte its INT8 input `index` can hold, in raw-byte order (an s8 -1 is
    entry 255); `inputs` holds the other inputs (one-value constants), None at `index`."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.view(torch.int8) if signed else codes
    with torch.inference_mode():
        return run_program(program, [x if i == index else v for i, v in enumerate(inputs)]).reshape(-1)


def pointwise(attrs, xs):
    return [run_program(attrs["program"], xs)]


KILN_OPS["Shuffle"] = OpDef("Shuffle", OpKind.INJECTIVE, shuffle)
KILN_OPS["PointWise"] = OpDef("PointWise", OpKind.ELEMENTWISE, pointwise)
def dequantized_weights(attrs, w: torch.Tensor) -> torch.Tensor:
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    return dequantize(w, torch.tensor(q["w_scale"]), torch.tensor(q["w_zero_point"]), q["w_axis"])


def run_quantized(base: str, attrs, x_q: torch.Tensor, w: torch.Tensor, rest: list) -> torch.Tensor:
    """An INT8 layer: dequantize the input, run the float op with (already dequantized) weights `w`, then
    quantize with the output scale if the layer has one (else the output stays FP32)."""
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    x = dequantize(x_q, q["x_scale"], q["x_zero_point"])
    if len(rest) > 1 and rest[1] is not None and "r_scale" in q:   # an INT8 residual summed before the activation
        rest = [rest[0], dequantize(rest[1], q["r_scale"], q["r_zero_point"])]
    if "mid_scale" in q:
        y = _rounded_before_bias(base, attrs, x, w, rest)
    else:
        y = OPS[base].impl(attrs, [x, w] + list(rest))[0]   # the base op ignores the extra "quant" attribute
    if "y_scale" in q:
        y = requantized(y, q)
    return y


def requantized(y: torch.Tensor, q: dict, at: str = "y") -> torch.Tensor:
    """`y` quantized at a layer's output scale, zero point and type (quant's y_*; `at="mid"`: its mid_*)."""
    from kiln.ops.dtypes import to_torch_dtype
    from kiln.ops.quantize import quantize

    return quantize(y, q[f"{at}_scale"], q[f"{at}_zero_point"], to_torch_dtype(np.dtype(q[f"{at}_dtype"])))


def _rounded_before_bias(base: str, attrs, x: torch.Tensor, w: torch.Tensor, rest: list) -> torch.Tensor:
    """The product rounded to INT8 at the mid scale and dequantized again (the model's Q -> DQ after it, which
    kiln.passes.quantization.fuse_requantized_bias keeps), then the bias (per output channel), residual and
    activation."""
    from kiln.ops.nn import apply_activation
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    y = OPS[base].impl({k: v for k, v in attrs.items() if k != "activation"}, [x, w])[0]
    y = dequantize(requantized(y, q, "mid"), q["mid_scale"], q["mid_zero_point"])
    bias, residual = (list(rest) + [None, None])[:2]
    if bias is not None:
        y = y + (bias.reshape(-1, *[1] * (y.dim() - 2)) if base == "Conv" else bias)
    if residual is not None:
        y = y + residual
    return apply_activation(attrs.get("activation"), y)


OPERAND_STEPS = ("a_steps", "b_steps")   # a QMatMul of two INT8 activations: its operands' steps
PRODUCT_STEPS = (*OPERAND_STEPS, "out_steps")   # ... and its result's (kiln.passes.qmatmul_steps)


def without_steps(attrs: dict) -> dict:
    """A product's attributes less its steps: the product alone, on operands already moved."""
    return {k: v for k, v in attrs.items() if k not in PRODUCT_STEPS}


def _quantized(base: str):
    def impl(attrs, xs):
        """A product of two INT8 activations reads them after their steps (kiln.passes.qmatmul_steps)."""
        x, w = (apply_steps(v, attrs.get(key, [])) for v, key in zip(xs[:2], OPERAND_STEPS))
        w = w if w.is_floating_point() else dequantized_weights(attrs, w)   # float: prepared once
        y = apply_steps(run_quantized(base, attrs, x, w, xs[2:]), attrs.get("out_steps", []))
        return [y if "out_table" not in attrs else apply_table(y, attrs["out_table"])]
    return impl


def apply_table(y: torch.Tensor, table: dict) -> torch.Tensor:
    """An INT8 tensor's bytes mapped through a 256-entry table of output bytes (kiln.passes.qproduct_table):
    {"bytes": [256 ints], "dtype": "uint8" | "int8"}, indexed by the raw byte (an s8 -1 reads entry 255)."""
    return mapped_bytes(y, table_bytes(table), INT8_TORCH[table["dtype"]])


def table_bytes(table: dict) -> torch.Tensor:
    """A byte table's entries as 256 uint8 values; a table of another size or type (a damaged engine) is refused
    here, before a kernel indexes past its end."""
    entries = table.get("bytes") if isinstance(table, dict) else None
    if not isinstance(entries, list) or len(entries) != 256 or table.get("dtype") not in INT8_TORCH:
        raise ValueError(f"a byte table needs 256 entries and an INT8 type; this one has "
                         f"{len(entries) if isinstance(entries, list) else 'no'} entries, type "
                         f"{table.get('dtype') if isinstance(table, dict) else None}")
    return torch.tensor(entries, dtype=torch.uint8)   # an entry outside 0..255 raises too


def mapped_bytes(y: torch.Tensor, entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """entries[raw byte of y] (256 uint8 entries) viewed as `dtype`: torch's indexing, where no C lookup runs."""
    return entries[y.view(torch.uint8).long()].view(dtype)


def _dequantize_weight_once(attrs, consts: dict) -> dict:
    return {**consts, 1: dequantized_weights(attrs, consts[1])} if 1 in consts else consts


QUANTIZED_BASE = {"QConv": "Conv", "QMatMul": "MatMul", "QGemm": "Gemm"}
for _name, _base in QUANTIZED_BASE.items():
    KILN_OPS[_name] = OpDef(_name, OpKind.COMPLEX, _quantized(_base), (), _dequantize_weight_once)

def dynamic_quantized_matmul(attrs, xs):
    """DynamicQuantizeLinear(x) -> MatMulInteger(x_u8, W) -> FP32 * (x_scale * w_scale) [+ bias] [-> activation]
    (the ops kiln.passes.dynamic_quant fuses; onnxruntime's DynamicQuantizeMatMul): exact integer sums, FP32 scales."""
    from kiln.ops.nn import apply_activation
    from kiln.ops.quantize import dynamic_qparams, quantize

    x, w, q = xs[0], xs[1], attrs["quant"]
    if x.device.type == "meta":
        return [torch.empty((*x.shape[:-1], w.shape[-1]), dtype=torch.float32, device="meta")]
    scale, zero = dynamic_qparams(x)
    x_u8 = quantize(x, scale, zero, torch.uint8)
    w = w if w.dtype == torch.float64 else centred_weights(attrs, w)   # float64: prepared once at load
    sums = torch.matmul(x_u8.double() - zero, w)   # exact: MatMulInteger's int32
    y = sums.float() * torch.from_numpy(scale * np.asarray(q["w_scale"], np.float32))
    return [apply_activation(attrs.get("activation"), y + xs[2] if len(xs) > 2 and xs[2] is not None else y)]


def dynamic_quantized_conv(attrs, xs):
    """DynamicQuantizeLinear(x) -> ConvInteger(x_u8, W) -> FP32 * (x_scale * w_scale) [+ bias] [+ residual]
    [-> activation] (kiln.passes.dynamic_quant's DynamicQConv): exact integer sums, FP32 scales per output channel."""
    from kiln.ops.nn import residual_then_activation
    from kiln.ops.quantize import dynamic_qparams, quantize

    x, w, q = xs[0], xs[1], attrs["quant"]
    conv = {k: v for k, v in attrs.items() if k not in ("quant", "activation")}
    if x.device.type == "meta":
        return OPS["Conv"].impl(conv, [x, w.to("meta", torch.float32)])
    scale, zero = dynamic_qparams(x)
    x_u8 = quantize(x, scale, zero, torch.uint8)
    w = w if w.dtype == torch.float64 else centred_weights(attrs, w)   # float64: prepared once at load
    sums = OPS["Conv"].impl(conv, [x_u8.double() - zero, w])[0]     # exact: ConvInteger's int32
    channel = (-1,) + (1,) * (sums.dim() - 2)
    y = sums.float() * torch.from_numpy(scale * np.asarray(q["w_scale"], np.float32)).reshape(channel)
    if len(xs) > 2 and xs[2] is not None:
        y = y + xs[2].reshape(channel)
    return [residual_then_activation(attrs, xs, y)]


def centred_weights(attrs, w: torch.Tensor) -> torch.Tensor:
    """W - W_zp in float64 (exact for INT8), what the product multiplies; the zero points run along `w_axis`."""
    q = attrs["quant"]
    zp = torch.tensor(q["w_zero_point"], dtype=torch.float64)
    return w.double() - zp.reshape((-1,) + (1,) * (w.dim() - 1 - q["w_axis"]))


def _centre_weights_once(attrs, consts: dict) -> dict:
    return {**consts, 1: centred_weights(attrs, consts[1])} if 1 in consts else consts


def quantized_add(attrs, xs):
    """INT8 residual add: dequantize both inputs, add, activation, quantize with the output scale."""
    from kiln.ops.nn import apply_activation
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    y = dequantize(xs[0], q["a_scale"], q["a_zero_point"]) + dequantize(xs[1], q["b_scale"], q["b_zero_point"])
    y = apply_activation(attrs.get("activation"), y)
    return [requantized(y, q)]


def quantized_softmax(attrs, xs):
    """INT8 Softmax: dequantize, softmax along `axis` in FP32, quantize with the output scale."""
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    p = torch.softmax(dequantize(xs[0], q["x_scale"], q["x_zero_point"]), dim=attrs.get("axis", -1))
    return [requantized(p, q)]


def _between_qdq(op_type: str, attrs, xs, own_keys=("quant",)):
    """Standard op `op_type` between its layer's DequantizeLinear and QuantizeLinear (kiln.passes.qpool): the INT8
    input dequantized, the op in FP32 with the layer's attributes less `own_keys`, quantized at the output scale."""
    from kiln.ops.quantize import dequantize

    q = attrs["quant"]
    y = OPS[op_type].impl({k: v for k, v in attrs.items() if k not in own_keys},
                          [dequantize(xs[0], q["x_scale"], q["x_zero_point"]), *xs[1:]])[0]
    return [requantized(y, q)]


def quantized_average_pool(attrs, xs):
    """INT8 average pool: `pool` (AveragePool, GlobalAveragePool or ReduceMean over H and W) between Q/DQ."""
    return _between_qdq(attrs["pool"], attrs, xs, ("pool", "quant"))


def quantized_resize(attrs, xs):
    """INT8 linear or cubic Resize between Q/DQ."""
    return _between_qdq("Resize", attrs, xs)


def quantized_layer_norm(attrs, xs):
    """INT8 LayerNormalization over the axes from `axis`: dequantize, normalize in FP32, quantize with the output
    scale. With `skip_quant` the first two inputs are a residual sum's, added and quantized as that QAdd would
    (its INT8 result is what the normalization reads); the scale and bias follow."""
    from kiln.ops.norm_resize import layer_norm
    from kiln.ops.quantize import dequantize

    q, skip = attrs["quant"], attrs.get("skip_quant")
    x = quantized_add({"quant": skip}, xs[:2])[0] if skip else xs[0]
    rest = xs[2:] if skip else xs[1:]
    y = layer_norm({k: attrs[k] for k in ("axis", "epsilon") if k in attrs},
                   [dequantize(x, q["x_scale"], q["x_zero_point"])] + list(rest))[0]
    return [requantized(y, q)]


def concat_with_tables(attrs, xs):
    """Concat of INT8 tensors, each input with an entry in `in_tables` first mapped through that 256-entry table
    (kiln.passes.qconcat_table: the requantizations to the Concat's scale)."""
    parts = [x if t is None else apply_table(x, t) for x, t in zip(xs, attrs["in_tables"]) if x is not None]
    return [torch.cat(parts, dim=attrs["axis"])]


KILN_OPS["QConcat"] = OpDef("QConcat", OpKind.INJECTIVE, concat_with_tables)
KILN_OPS["QAdd"] = OpDef("QAdd", OpKind.ELEMENTWISE, quantized_add)
KILN_OPS["QSoftmax"] = OpDef("QSoftmax", OpKind.REDUCTION, quantized_softmax)
KILN_OPS["QLayerNorm"] = OpDef("QLayerNorm", OpKind.REDUCTION, quantized_layer_norm)
KILN_OPS["QAveragePool"] = OpDef("QAveragePool", OpKind.REDUCTION, quantized_average_pool, (1,))   # ReduceMean's axes
KILN_OPS["QResize"] = OpDef("QResize", OpKind.INJECTIVE, quantized_resize, (1, 2, 3))   # roi, scales, sizes
KILN_OPS["DynamicQMatMul"] = OpDef("DynamicQMatMul", OpKind.COMPLEX, dynamic_quantized_matmul, (),
                                   _centre_weights_once)
KILN_OPS["DynamicQConv"] = OpDef("DynamicQConv", OpKind.COMPLEX, dynamic_quantized_conv, (), _centre_weights_once)
KILN_OPS["Attention"] = OpDef("Attention", OpKind.OPAQUE, attention)
KILN_OPS["SkipLayerNormalization"] = OpDef("SkipLayerNormalization", OpKind.OPAQUE, skip_layer_norm)
KILN_OPS["RotaryEmbedding"] = OpDef("RotaryEmbedding", OpKind.OPAQUE, rotary_embedding)
