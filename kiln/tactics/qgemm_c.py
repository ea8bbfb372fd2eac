"""kiln's own INT8 kernels in C (kiln/native/csrc/qgemm.c) on AVX512-VNNI's `vpdpbusd`: QConv as a GEMM (1x1,
strides read in place) or a direct convolution (any kernel, stride and padding; windows read in place), QGemm and
QMatMul by a constant matrix. The semantics are the oneDNN INT8 tactics' (kiln.tactics.onednn_int8): u8 or s8
activations (s8 read as u8 with the top bit flipped, zero point + 128), s8 weights per tensor or per output
channel, a constant FP32 bias, the residual (INT8, or FP32) summed before the activation (ReLU, Clip, Swish,
GELU), and FP32 out or requantized to u8/s8 (round half to even, saturated). Unlike oneDNN's, they also take
weights with zero points (asymmetric s8, and u8 read as s8): onnxruntime's quantize_static gives those to a
MatMul whose weights the graph computes (a Transpose of an initializer).

The weights are packed once at load into 32-column panels of 4-byte quads, [n/32][k/4][32][4], with the column
sums that undo the activation zero point (padded pixels hold the zero point, so the same sum holds at borders);
weight zero points take each row's byte sum times the zero point off as well.
Why kiln has its own beside oneDNN's: a oneDNN INT8 call through torch spends 20-30 µs on descriptors, kiln's
3-4.5 µs (benchmarks/overhead.py), which decides small layers. On ResNet-50's layers (one Zen 4 thread) kiln's
kernels take 0.88-1.13x oneDNN's time, the classifier 0.5x, the 3-channel stem 1.35x. Listed after oneDNN: the
autotuner times both and keeps the faster per layer."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import hardware, native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import table_bytes
from kiln.ops.quantize import RANGES
from kiln.tactics.base import HWC, LINEAR, Kernel, LayerView, batch_dynamic_only, has_residual
from kiln.tactics.conv_direct import conv_geometry
from kiln.tactics.gemm_c import ONE_LINE, fused_activation, nhwc_kernel
from kiln.tactics.onednn_int8 import _channel_axis, _output, _quant_supported, _scales, linear_supported, \
    unsigned_input

VNNI_ISA = ("avx512_vnni",)
PANEL = native.header_constant("qgemm.c", "NR")   # columns per packed weight panel, defined once in qgemm.c
TABLE_BYTES = native.header_constant("qgemm.c", "TABLE_BYTES")   # an output table's bytes, padded for a gather
QUAD = 4                                          # k bytes per int32 lane: what one vpdpbusd sums
OUT_KINDS = {None: 0, "uint8": 1, "int8": 2}   # qgemm.c's OUT_F32, OUT_U8, OUT_S8 (None: no y_scale, FP32 out)
MAX_K = (2**31 - 1) // (255 * 128)   # products summed per output (65,793) before an int32 sum could overflow
MAX_K_ZERO_POINTS = (2**31 - 1) // (255 * 255)   # (x - x_zp)(w - w_zp) products (33,025): weights with zero points


class Epilogue(ctypes.Structure):
    """qgemm.c's QEpilogue, field by field: everything after the int32 sums, fixed at load."""

    _fields_ = [("comp", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("clamp_lo", ctypes.c_float), ("clamp_hi", ctypes.c_float), ("r_scale", ctypes.c_float),
                ("y_scale", ctypes.c_float), ("r_zp", ctypes.c_int32), ("y_zp", ctypes.c_int32),
                ("act", ctypes.c_int32), ("out_kind", ctypes.c_int32), ("signed_input", ctypes.c_int32),
                ("pad_byte", ctypes.c_int32), ("r_kind", ctypes.c_int32), ("w_zp", ctypes.c_void_p),
                ("mid_scale", ctypes.c_float), ("mid_zp", ctypes.c_int32), ("mid_kind", ctypes.c_int32),
                ("y_lo", ctypes.c_float), ("y_hi", ctypes.c_float), ("mid_lo", ctypes.c_float),
                ("mid_hi", ctypes.c_float), ("table", ctypes.c_void_p)]


I64 = ctypes.c_int64


class GemmCall(ctypes.Structure):
    """qgemm.c's QGemmCall: a GEMM layer's constants, built once at load."""

    _fields_ = [("b", ctypes.c_void_p), *((name, I64) for name in ("a_batch", "row_width", "col_step", "line_step",
                                                                    "c_batch", "batch", "k", "n")),
                ("e", Epilogue)]


class ConvCall(ctypes.Structure):
    """qgemm.c's QConvCall: a direct convolution's constants, built once at load."""

    _fields_ = [("b", ctypes.c_void_p), *((name, I64) for name in ("n", "h", "w", "c", "kh", "kw", "sh", "sw", "pt",
                                                                    "pl", "oh", "ow", "cout")),
                ("e", Epilogue)]


def per_batch(make):
    """`calls(batch)`: the address of the call structure `make(batch)` builds, one per batch size seen (kept alive
    here), so a layer with a dynamic batch needs no per-call structure and concurrent calls share none they write."""
    made: dict[int, ctypes.Structure] = {}

    def calls(batch: int) -> int:
        call = made.get(batch)
        if call is None:
            call = made.setdefault(batch, make(batch))
        return ctypes.addressof(call)
    calls.made = made
    return calls




def pack_quads(w: torch.Tensor, k_multiple: int = QUAD) -> torch.Tensor:
    """s8 [k, n] -> [panels, k/4, 32, 4]: lane j of quad q holds rows 4q..4q+3 of column j; k padded to a
    multiple of `k_multiple` (of whole quads) and the columns to whole panels with zero weights."""
    k, n = w.shape
    quads, panels = -(-k // k_multiple) * k_multiple // QUAD, -(-n // PANEL)
    padded = torch.zeros((quads * QUAD, panels * PANEL), dtype=torch.int8)
    padded[:k, :n] = w
    return padded.view(quads, QUAD, panels, PANEL).permute(2, 0, 3, 1).contiguous()


def pack_segments(w: torch.Tensor, k_multiple: int = QUAD) -> torch.Tensor:
    """s8 [kh, kw * c, cout] -> kiln_qconv's panels: each kernel row's segment padded to a multiple of
    `k_multiple` (of whole quads), so no quad straddles two rows."""
    kh, seg, cout = w.shape
    padded = torch.zeros((kh, -(-seg // k_multiple) * k_multiple, cout), dtype=torch.int8)
    padded[:, :seg] = w
    return pack_quads(padded.reshape(-1, cout))


def _padded(values: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(-(-n // PANEL) * PANEL, dtype=dtype)
    out[:n] = values.reshape(-1)
    return out


def s8_weights(layer: LayerView) -> torch.Tensor:
    """The layer's constant INT8 weights as the kernels multiply them: s8, u8 ones shifted by -128 (exact; their
    zero points shift with them: `weight_zero_points`)."""
    w = layer.const_inputs[1]
    return w if w.dtype == torch.int8 else (w.to(torch.int16) - 128).to(torch.int8)


def weight_zero_points(layer: LayerView) -> torch.Tensor | None:
    """The zero points of `s8_weights` as int32, one or one per output channel; None where all are 0."""
    q = layer.attrs["quant"]
    zp = torch.tensor(q["w_zero_point"], dtype=torch.int32).reshape(-1)
    if layer.const_inputs[1].dtype == torch.uint8:
        zp = zp - 128
    return zp if bool(zp.any()) else None


def k_fits(layer: LayerView, k: int) -> bool:
    """Whether `k` products per output stay within the int32 sums for this layer's weights."""
    return k <= (MAX_K if weight_zero_points(layer) is None else MAX_K_ZERO_POINTS)


def column_sums(layer: LayerView, w_kn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what the activation's zero point multiplies per column: sum_k W - k * W_zp, the weights' zero points
    padded per column or None) for `s8_weights` as [k, n], each padded to whole panels."""
    k, n = w_kn.shape
    sums, zp = w_kn.to(torch.int32).sum(0), weight_zero_points(layer)
    if zp is None:
        return _padded(sums, n, torch.int32), None
    zp = zp.expand(n)
    return _padded(sums - k * zp, n, torch.int32), _padded(zp, n, torch.int32)


def epilogue(layer: LayerView, w_kn: torch.Tensor) -> tuple[Epilogue, tuple[torch.Tensor, ...]]:
    """The layer's QEpilogue for weights `w_kn` ([k, n] `s8_weights`) and the tensors it points into (keep them
    alive)."""
    q, n = layer.attrs["quant"], w_kn.shape[1]
    x_zp = unsigned_input(q)[0]
    colsum, w_zp = column_sums(layer, w_kn)
    comp = colsum * x_zp
    scale = _padded(_scales(layer)[0].double() * float(q["x_scale"]), n, torch.float32)
    bias = layer.const_inputs.get(2)
    bias = None if bias is None else _padded(bias.float(), n, torch.float32)
    lo, hi, act = fused_activation(layer.attrs.get("activation"))
    y_scale, y_zp, _ = _output(layer)
    e = Epilogue(comp.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), lo, hi,
                 float(q.get("r_scale", 1.0)), y_scale, int(q.get("r_zero_point", 0)), y_zp, act,
                 OUT_KINDS[output_type(q)], int(q["x_dtype"] == "int8"), int(q["x_zero_point"]) & 0xFF,
                 _residual_kind(layer), None if w_zp is None else w_zp.data_ptr(), *rounding_fields(q, y_zp))
    table = output_table(layer)
    e.table = None if table is None else table.data_ptr()
    return e, tuple(t for t in (comp, scale, bias, w_zp, table) if t is not None)


def output_table(layer: LayerView) -> torch.Tensor | None:
    """The 256 output bytes a product's requantized byte maps to (kiln.passes.qproduct_table), padded as qgemm.c's
    epilogue reads them; None where the layer has none."""
    table = layer.attrs.get("out_table")
    if table is None:
        return None
    return torch.cat([table_bytes(table), torch.zeros(TABLE_BYTES - 256, dtype=torch.uint8)])


def output_type(q: dict) -> str | None:
    """The INT8 type a layer's quant requantizes its output to; None for an FP32 output."""
    return q.get("y_dtype") if "y_scale" in q else None


def rounding_fields(q: dict, y_zp: int) -> tuple:
    """QEpilogue's last fields from a layer's quant: the rounding before the bias (mid_scale, mid_zp, mid_kind;
    OUT_F32 where there is none), then the clamp bounds of the output and of that rounding."""
    mid_zp = int(q.get("mid_zero_point", 0))
    return (float(q.get("mid_scale", 1.0)), mid_zp, OUT_KINDS[q.get("mid_dtype")],
            *_clamp_bounds(output_type(q), y_zp), *_clamp_bounds(q.get("mid_dtype"), mid_zp))


def _clamp_bounds(dtype: str | None, zero_point: int) -> tuple[float, float]:
    """quantize16's clamp for an output of `dtype` at `zero_point`: the type's range less the zero point (FP32
    outputs: unused)."""
    lo, hi = RANGES[getattr(torch, dtype)] if dtype else (0, 0)
    return float(lo - zero_point), float(hi - zero_point)


def _residual_kind(layer: LayerView) -> int:
    """The residual's type as qgemm.c's r_kind: an INT8 one's, else FP32 (also where there is none)."""
    return OUT_KINDS.get(layer.input_dtypes[3], OUT_KINDS[None]) if has_residual(layer) else OUT_KINDS[None]


def vnni_available() -> bool:
    return hardware.has_any(VNNI_ISA) and native.available()



def output_dtype(layer: LayerView) -> torch.dtype:
    """The torch dtype of the layer's output: its INT8 type where it requantizes (its table's where it has one),
    else float32."""
    q, table = layer.attrs["quant"], layer.attrs.get("out_table")
    if table is not None:
        return INT8_TORCH[table["dtype"]]
    return INT8_TORCH[q["y_dtype"]] if "y_scale" in q else torch.float32


def _conv_supported(layer: LayerView) -> bool:
    """A 2-D QConv with constant INT8 weights (s8 or u8, with zero points or without), one group, dilation 1,
    explicit pads, an activation the kernel has, and a residual (if fused) of the output's shape: of its INT8
    type, or FP32 (a TensorRT-style QAT export's unquantized residual sum)."""
    if layer.op_type != "QConv" or layer.domain != "kiln" or len(layer.input_shapes[0] or ()) != 4:
        return False
    a, w = layer.attrs, layer.const_inputs.get(1)
    if w is None or w.dim() != 4 or a.get("group", 1) != 1 or any(d != 1 for d in a.get("dilations") or [1, 1]):
        return False
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "", b"NOTSET") or not _quant_supported(layer, True, mid=True):
        return False
    if fused_activation(a.get("activation")) is None or not batch_dynamic_only(layer):
        return False
    kh, kw, sh, sw, pt, pl, oh, ow = conv_geometry(layer)
    if oh < 1 or ow < 1 or min(pt, pl) < 0 or not k_fits(layer, kh * kw * layer.input_shapes[0][1]):
        return False
    if has_residual(layer):
        q = layer.attrs["quant"]
        out = (layer.input_shapes[0][0], w.shape[0], oh, ow)
        if layer.input_dtypes[3] not in (q.get("y_dtype"), "float32") or tuple(layer.input_shapes[3]) != out:
            return False
    return vnni_available()


class QConvGemmTactic:
    """A 1x1 QConv without padding: [pixels x Cin] . [Cin x Cout], strided rows read in place."""

    name = "kiln.qconv2d_1x1_gemm_nhwc_int8"
    source = "kiln"
    needs_c_compiler = True
    required_isa = VNNI_ISA
    entry_point = "kiln_qgemm"           # the AMX variants (kiln.tactics.qgemm_amx) swap these two
    pack = staticmethod(pack_quads)

    def supports(self, layer: LayerView) -> bool:
        if not _conv_supported(layer):
            return False
        return tuple(layer.const_inputs[1].shape[2:]) == (1, 1) and not any(layer.attrs.get("pads") or [0])

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        gemm = getattr(native.library("qgemm"), self.entry_point)
        n, c, h, w = layer.input_shapes[0]
        weight = s8_weights(layer)
        cout = weight.shape[0]
        _, _, sh, sw, _, _, oh, ow = conv_geometry(layer)
        w_kn = weight.reshape(cout, c).t()
        packed = self.pack(w_kn)
        e, kept = epilogue(layer, w_kn)
        calls = per_batch(lambda batch: GemmCall(packed.data_ptr(), h * w * c, ow, sw * c, sh * w * c,
                                                 oh * ow * cout, batch, c, cout, e))
        m = oh * ow

        def launch(x, out, res):
            gemm(calls(x.shape[0]), x.data_ptr(), out.data_ptr(), None if res is None else res.data_ptr(), m)
        run = nhwc_kernel(launch, (n, cout, oh, ow), None, has_residual(layer), output_dtype(layer))
        run.constants = (packed, calls, kept)   # read through raw pointers
        return run


class QConvDirectTactic(QConvGemmTactic):
    """Any other QConv: each output pixel's window read in place, one segment of kw x Cin bytes per kernel row."""

    name = "kiln.qconv2d_direct_nhwc_int8"
    entry_point = "kiln_qconv"
    pack = staticmethod(pack_segments)

    def supports(self, layer: LayerView) -> bool:
        if not _conv_supported(layer):
            return False
        return tuple(layer.const_inputs[1].shape[2:]) != (1, 1) or any(layer.attrs.get("pads") or [0])

    def packed_calls(self, layer: LayerView, weight: torch.Tensor, make_epilogue) -> tuple:
        """(packed weights, calls(batch), the tensors the epilogue points into, output shape): the load-time part
        for s8 `weight` [cout, c, kh, kw], the epilogue from `make_epilogue(layer, weights as [k, n])`."""
        n, c, h, w = layer.input_shapes[0]
        cout = weight.shape[0]
        kh, kw, sh, sw, pt, pl, oh, ow = conv_geometry(layer)
        w_rows = weight.permute(2, 3, 1, 0).reshape(kh, kw * c, cout)   # [kh][kw * c][cout]
        packed = self.pack(w_rows)
        e, kept = make_epilogue(layer, w_rows.reshape(-1, cout))
        calls = per_batch(lambda batch: ConvCall(packed.data_ptr(), batch, h, w, c, kh, kw, sh, sw, pt, pl, oh, ow,
                                                 cout, e))
        return packed, calls, kept, (n, cout, oh, ow)

    def prepare(self, layer: LayerView) -> Kernel:
        conv = getattr(native.library("qgemm"), self.entry_point)
        packed, calls, kept, out_shape = self.packed_calls(layer, s8_weights(layer), epilogue)

        def launch(x, out, res):
            conv(calls(x.shape[0]), x.data_ptr(), out.data_ptr(), None if res is None else res.data_ptr())
        run = nhwc_kernel(launch, out_shape, None, has_residual(layer), output_dtype(layer))
        run.constants = (packed, calls, kept)
        return run


class QLinearGemmTactic:
    """QGemm and QMatMul by a constant INT8 matrix: the activation's rows are the GEMM's, counted per call."""

    name = "kiln.qmatmul_gemm_int8"
    source = "kiln"
    needs_c_compiler = True
    required_isa = VNNI_ISA
    entry_point = "kiln_qgemm"
    pack = staticmethod(pack_quads)

    def supports(self, layer: LayerView) -> bool:
        if not linear_supported(layer, zero_points=True, mid=True) or not k_fits(layer, layer.input_shapes[0][-1]):
            return False
        dynamic = layer.input_dynamic[0] if layer.input_dynamic else ()
        return fused_activation(layer.attrs.get("activation")) is not None and \
            len(layer.input_shapes[0]) - 1 not in dynamic and vnni_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def packed_call(self, layer: LayerView, w_kn: torch.Tensor, make_epilogue) -> tuple:
        """(packed weights, GemmCall, the tensors the epilogue points into): the load-time part for s8 `w_kn`
        [k, n], the epilogue from `make_epilogue(layer, w_kn)`."""
        k, n = w_kn.shape
        packed = self.pack(w_kn)
        e, kept = make_epilogue(layer, w_kn)
        return packed, GemmCall(packed.data_ptr(), 0, ONE_LINE, k, 0, 0, 1, k, n, e), kept

    def prepare(self, layer: LayerView) -> Kernel:
        gemm = getattr(native.library("qgemm"), self.entry_point)
        w = s8_weights(layer)
        packed, call, kept = self.packed_call(layer, w.t() if _channel_axis(layer) == 0 else w, epilogue)
        call_ptr = ctypes.addressof(call)
        run = rows_kernel(call.k, call.n, output_dtype(layer), lambda x, y, rows: gemm(call_ptr, x, y, None, rows))
        run.constants = (packed, call, kept)
        return run


def rows_kernel(k: int, n: int, dtype: torch.dtype, launch) -> Kernel:
    """A kernel over its input's rows of k values writing [..., n] of `dtype` by `launch(x_ptr, y_ptr, rows)`."""
    def run(xs):
        x = xs[0] if xs[0].is_contiguous() else xs[0].contiguous()
        rows = x.numel() // k
        y = torch.empty((*x.shape[:-1], n), dtype=dtype)
        if rows:
            launch(x.data_ptr(), y.data_ptr(), rows)
        return [y]
    return run
