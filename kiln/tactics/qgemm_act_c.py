"""kiln's INT8 product of two activations in C (kiln/native/csrc/qgemm_act.h): a QMatMul whose B the graph
computes, as a Q/DQ model's attention has them (Q.K^T, then the probabilities times V). Both inputs are u8 or s8
with per-tensor scales and zero points; each image's B is packed into kiln_qgemm's panels on every call (u8 read
as s8 with its zero point less 128, taken off by the rows' byte sums as weight zero points are) and the images run
on kiln_qgemm's loop, with its epilogue: requantized u8/s8 or FP32 out, the bias and activation where the passes
fused them. Leading (batch, head) dimensions must be equal on both inputs; they and k (P.V's sequence length)
may vary per call, a k past the kernel's int32 sums running torch's formula."""
from __future__ import annotations

import ctypes

import torch

from kiln import native
from kiln.ops import lookup
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import OPERAND_STEPS, apply_steps, without_steps
from kiln.tactics.base import LINEAR, Kernel, LayerView
from kiln.tactics.gemm_c import ONE_LINE
from kiln.tactics.onednn_int8 import unsigned_input
from kiln.tactics.qgemm_c import (MAX_K_ZERO_POINTS, OUT_KINDS, VNNI_ISA, Epilogue, GemmCall, _padded,
                                  fused_activation, output_dtype, output_table, output_type, rounding_fields,
                                  vnni_available)

MAX_SHAPES = 64   # (batch, m, k, n) call structures, and epilogues per n, kept per layer


class QActMatMulTactic:
    """QMatMul of two INT8 activations, batched over their equal leading dimensions."""

    name = "kiln.qmatmul_act_int8"
    source = "kiln"
    needs_c_compiler = True
    required_isa = VNNI_ISA

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "QMatMul" or layer.domain != "kiln" or 1 in layer.const_inputs:
            return False
        q, (a, b), dyn = layer.attrs.get("quant") or {}, operand_shapes(layer), operand_dynamic_axes(layer)
        if not q or a is None or b is None or dyn is None or len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2] or \
                a[-1] != b[-2]:
            return False
        if layer.input_dtypes[0] not in INT8_TORCH or q.get("x_dtype") != layer.input_dtypes[0] or \
                layer.input_dtypes[1] not in INT8_TORCH or len(q["w_scale"]) != 1 or len(q["w_zero_point"]) != 1:
            return False
        k_axis = len(a) - 1
        dynamic_k = k_axis in dyn[0] or k_axis - 1 in dyn[1]
        bias, dynamic_n = layer.const_inputs.get(2), k_axis in dyn[1]
        extra_ok = all(v is None for v in layer.input_shapes[3:]) and \
            (len(layer.input_shapes) < 3 or layer.input_shapes[2] is None or
             (bias is not None and bias.dim() == 1 and bias.numel() == b[-1] and not dynamic_n))
        lead_ok = {x for x in dyn[0] if x < k_axis - 1} == {x for x in dyn[1] if x < k_axis - 1}   # both vary
        return (dynamic_k or 0 < a[-1] <= MAX_K_ZERO_POINTS) and extra_ok and lead_ok and \
            q.get("y_dtype", "uint8") in INT8_TORCH and q.get("mid_dtype", "uint8") in INT8_TORCH and \
            fused_activation(layer.attrs.get("activation")) is not None and vnni_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        product = native.library("qgemm").kiln_qgemm_act
        q = layer.attrs["quant"]
        x_zp = unsigned_input(q)[0]   # the kernel flips s8 input bytes itself (signed_input)
        b_unsigned = int(layer.input_dtypes[1] == "uint8")
        out_dtype = output_dtype(layer)
        calls = _calls(layer)
        bias = [layer.const_inputs[2]] if 2 in layer.const_inputs else []
        reference = lookup("QMatMul", "kiln").impl
        operand_steps = [layer.attrs.get(key, []) for key in OPERAND_STEPS]
        out_steps = layer.attrs.get("out_steps", [])
        plain = without_steps(layer.attrs)

        def finish(y: torch.Tensor) -> list[torch.Tensor]:
            return [apply_steps(y, out_steps).contiguous() if out_steps else y]

        def run(xs):
            a, b = (apply_steps(x, steps) for x, steps in zip(xs[:2], operand_steps))
            a, b = (x if x.is_contiguous() else x.contiguous() for x in (a, b))
            *lead, m, k = a.shape
            n = b.shape[-1]
            if tuple(b.shape[:-1]) != (*lead, k):   # the kernel reads one B per A image: never past B's end
                raise ValueError(f"INT8 product: B's shape {list(b.shape)} does not follow A's {list(a.shape)}")
            if not 0 < k <= MAX_K_ZERO_POINTS:   # a sequence length past the int32 sums (or none): torch's way
                return finish(reference(plain, [a, b] + bias)[0])
            y = torch.empty((*lead, m, n), dtype=out_dtype)
            if y.numel():
                call = calls(int(torch.Size(lead).numel()), m, k, n)   # held (alive) until the call returns
                product(ctypes.addressof(call[0]), a.data_ptr(), b.data_ptr(), y.data_ptr(), m, x_zp, b_unsigned)
            return finish(y)
        run.constants = calls
        return run


def operand_shapes(layer: LayerView) -> list[tuple[int, ...] | None]:
    """A and B's shapes as the product reads them: after their steps (kiln.passes.qmatmul_steps)."""
    return [shape if not layer.attrs.get(key) or shape is None else
            tuple(apply_steps(torch.empty(shape, device="meta"), layer.attrs[key]).shape)
            for shape, key in zip(layer.input_shapes[:2], OPERAND_STEPS)]


def operand_dynamic_axes(layer: LayerView) -> list[set[int]] | None:
    """The axes of A and B that vary with the input shapes, as the product reads them (after their steps): the
    steps applied at the opt shapes and at shapes twice as large on every dynamic axis, the axes whose sizes differ.
    None where the steps do not fit the larger shapes."""
    out = []
    for i, key in enumerate(OPERAND_STEPS):
        dyn = layer.input_dynamic[i] if i < len(layer.input_dynamic) else ()
        steps, shape = layer.attrs.get(key), layer.input_shapes[i]
        if not steps or not dyn or shape is None:
            out.append(set(dyn))
            continue
        grown = tuple(2 * d if axis in dyn else d for axis, d in enumerate(shape))
        try:
            small, large = (apply_steps(torch.empty(s, device="meta"), steps).shape for s in (shape, grown))
        except RuntimeError:
            return None
        out.append({axis for axis, (s, t) in enumerate(zip(small, large)) if s != t})
    return out


def _calls(layer: LayerView):
    """`calls(batch, m, k, n)`: (the GemmCall for that shape, the epilogue's tensors it points into), built on
    first sight and kept. The epilogue (the scales and weight zero points padded to n columns, the bias) depends on
    n only and is kept per n; a GemmCall is a small struct around it."""
    made: dict[tuple[int, ...], tuple] = {}
    epilogues = _epilogues(layer)

    def calls(batch: int, m: int, k: int, n: int) -> tuple:
        """Shapes past the first MAX_SHAPES are built per call, so a dynamic sequence length does not grow the
        cache without bound; concurrent first calls keep one entry."""
        key = (batch, m, k, n)
        entry = made.get(key)
        if entry is None:
            e, tensors = epilogues(n)
            entry = (GemmCall(None, m * k, ONE_LINE, k, 0, m * n, batch, k, n, e), tensors)
            if len(made) < MAX_SHAPES:
                entry = made.setdefault(key, entry)
        return entry
    calls.made = made
    return calls


def _epilogues(layer: LayerView):
    """`epilogue(n)`: (the Epilogue for n output columns, the tensors it points into), kept per n (the first
    MAX_SHAPES of them)."""
    q = layer.attrs["quant"]
    made: dict[int, tuple] = {}
    w_zp = int(q["w_zero_point"][0]) - (128 if layer.input_dtypes[1] == "uint8" else 0)
    bias = layer.const_inputs.get(2)
    lo, hi, act = fused_activation(layer.attrs.get("activation"))
    y_scale, y_zp = float(q.get("y_scale", 1.0)), int(q.get("y_zero_point", 0))
    table = output_table(layer)

    def epilogue(n: int) -> tuple:
        entry = made.get(n)
        if entry is None:
            scale = _padded(torch.full((n,), float(q["x_scale"]) * float(q["w_scale"][0]), dtype=torch.float64),
                            n, torch.float32)
            zps = _padded(torch.full((n,), w_zp, dtype=torch.int32), n, torch.int32) if w_zp else None
            b = None if bias is None else _padded(bias.float(), n, torch.float32)
            e = Epilogue(None, scale.data_ptr(), None if b is None else b.data_ptr(), lo, hi, 1.0, y_scale, 0, y_zp,
                         act, OUT_KINDS[output_type(q)], int(q["x_dtype"] == "int8"), 0, OUT_KINDS[None],
                         None if zps is None else zps.data_ptr(), *rounding_fields(q, y_zp))
            e.table = None if table is None else table.data_ptr()
            entry = (e, (scale, zps, b, table))
            if len(made) < MAX_SHAPES:
                entry = made.setdefault(n, entry)
        return entry
    return epilogue
