"""kiln's own float32 GEMM in C (kiln/native/csrc/gemm.h, gemm.c): C[m x n] = A[m x k] · B[k x n] (+ bias,
+ residual, ReLU), for 1x1 convolutions on channel-major (NHWC) activations and the per-tile-position products
of Winograd convolutions; this module holds the Python side (weight packing, epilogue, NHWC launch).

B (the weights) is packed once at load into panels of 32 columns, [n/32][k][32], so the inner loop reads it
as two straight vectors per step; A is read in place, one row per output pixel (row r at
`(r / row_width) * line_step + (r % row_width) * col_step`, which covers strided 1x1 convolutions without a
copy). A 6 x 32 register tile (12 vector accumulators) is the micro-kernel; a partial tile of rows repeats its
first row and stores only the real ones. The output may be the residual's own buffer (each element is read
before it is written, by the same thread). Bias, residual and the fused activation (`Act`: ReLU, Clip, Swish,
GELU, HardSwish, HardSigmoid, Sigmoid, Tanh) are applied as the tile is stored.
OpenMP shares (batch, column panel, row chunk) units out on torch's own thread pool, row chunks outermost where the
weights fit in L2 (ROWS_OUTER_BYTES).

Measured on the 2-core AVX-512 CPU of this project: 200-220 GFLOP/s on ResNet-50's Winograd products, where
torch.bmm (MKL) reaches 120-190.
"""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import native
from kiln.ops.nn import apply_activation
from kiln.tactics.base import HWC, MEMORY_ORDER
from kiln.tactics.views import row_step

# The micro-kernel's register tile, defined once in kiln/native/csrc/gemm.h: weights are packed to match it.
PANEL = native.header_constant("gemm.h", "NR")      # columns per packed weight panel: two 16-float vectors
ROW_TILE = native.header_constant("gemm.h", "MR")   # rows per register tile
ACT_RELU, ACT_SWISH, ACT_GELU_ERF, ACT_GELU_TANH, ACT_HARDSWISH, ACT_HARDSIGMOID, ACT_SIGMOID, ACT_TANH = (
    native.header_constant("activation.h", name) for name in
    ("ACT_RELU", "ACT_SWISH", "ACT_GELU_ERF", "ACT_GELU_TANH", "ACT_HARDSWISH", "ACT_HARDSIGMOID", "ACT_SIGMOID",
     "ACT_TANH"))


def epilogue_inputs_fit(layer, out_shape: tuple[int, ...]) -> bool:
    """A convolution's bias (input 2) is a constant where given, and its fused residual (input 3) has exactly the
    output's shape and dtype: a residual that broadcasts is added by the Add layer's own kernel."""
    shapes = layer.input_shapes
    if len(shapes) > 2 and shapes[2] is not None and 2 not in layer.const_inputs:
        return False
    return len(shapes) < 4 or shapes[3] is None or (tuple(shapes[3]) == tuple(out_shape)
                                                    and layer.input_dtypes[3] == "float32")


def nhwc_kernel(launch, out_shape: tuple[int, ...], spec: dict | None, has_residual: bool,
                out_dtype: torch.dtype = torch.float32, fused: bool | None = None):
    """The kernel around a C launch `launch(x, out, residual)` that writes an NHWC output (of `out_dtype`, its
    batch the input's) with bias, residual and the activation `spec` applied as it stores where `fused` (by
    default: where activation_code has it); otherwise the activation runs after it. With a residual it carries
    `into_input` (kiln.runtime.donation): the variant writing over the residual's dead buffer, each element read
    before it is overwritten."""
    fused = bool(activation_code(spec)) if fused is None else fused
    post = spec if spec and not fused else None
    last = torch.channels_last
    _, c, h, w = out_shape
    strides = (h * w * c, 1, w * c, c)   # channel-major; torch.empty_strided costs ~0.6 µs less than memory_format

    def finish(out):
        return [apply_activation(post, out) if post else out]

    def run(xs):
        out = torch.empty_strided((xs[0].shape[0], c, h, w), strides, dtype=out_dtype)   # the batch: per call
        launch(xs[0].contiguous(memory_format=last), out,
               xs[3].contiguous(memory_format=last) if has_residual else None)
        return finish(out)

    def run_into_residual(xs):
        r = xs[3]
        if r.dtype != out_dtype or not r.is_contiguous(memory_format=last):
            return run(xs)
        launch(xs[0].contiguous(memory_format=last), r, r)
        return finish(r)
    if has_residual:
        run.into_input = (3, run_into_residual)
    return run


def write_into_rows(run, launch_rows, out_chw: tuple[int, int, int], out_dtype: torch.dtype):
    """`write_into` (kiln.runtime.elision) for an NHWC kernel without residual or post-pass activation:
    `launch_rows(x, out, step)` writes output pixels `step` elements apart where `out` is a channel slice of a
    wider channel-major tensor; computed, then copied, otherwise."""
    cout, oh, ow = out_chw

    def write_into(xs, out):
        x = xs[0].contiguous(memory_format=torch.channels_last)
        fits = out.dtype == out_dtype and tuple(out.shape) == (x.shape[0], cout, oh, ow)
        step = row_step(out, MEMORY_ORDER[HWC], 3) if fits else None
        if step is None:
            out.copy_(run(xs)[0])
        else:
            launch_rows(x, out, step)
    return write_into


def write_into_slice(run, call: "GemmCall", gemm, out_chw: tuple[int, int, int], out_dtype: torch.dtype):
    """write_into_rows for a GEMM: output rows `ldc` apart, through a copy of the call structure per row step
    (made once)."""
    calls: dict[int, GemmCall] = {}
    oh, ow = out_chw[1:]

    def launch_rows(x, out, step):
        if step not in calls:
            wide = GemmCall.from_buffer_copy(call)
            wide.ldc, wide.c_batch = step, oh * ow * step
            calls[step] = wide
        gemm(ctypes.addressof(calls[step]), x.data_ptr(), out.data_ptr(), None, x.shape[0], oh * ow)
    return write_into_rows(run, launch_rows, out_chw, out_dtype)


def no_io_flags(layer) -> int:
    """The FP32 entry points' `io` field: every tensor FP32 (the BF16 ones read the plan's storage, gemm_bf16)."""
    return 0


class Act(ctypes.Structure):
    """gemm.h's Act: the fused activation its epilogue applies after the bias and residual, the sum clamped to
    [lo, hi] where `clamp`, then `code` (activation.h; HardSigmoid reads alpha and beta). Act() applies nothing."""

    _fields_ = [("code", ctypes.c_int32), ("clamp", ctypes.c_int32), ("lo", ctypes.c_float), ("hi", ctypes.c_float),
                ("alpha", ctypes.c_float), ("beta", ctypes.c_float)]


def fused_activation(spec: dict | None) -> tuple[float, float, int] | None:
    """(clamp low, clamp high, activation.h's ACT_* code) the kernel applies after the sum; None for an activation
    it has not."""
    if not spec:
        return -math.inf, math.inf, 0
    attrs = spec.get("attrs", {})
    if spec["op"] == "Relu":
        return 0.0, math.inf, 0
    if spec["op"] == "Clip":
        return float(attrs.get("min", -math.inf)), float(attrs.get("max", math.inf)), 0
    if spec["op"] == "Swish" and attrs.get("alpha", 1.0) == 1.0:
        return -math.inf, math.inf, ACT_SWISH
    if spec["op"] == "Gelu":
        tanh = attrs.get("approximate", "none") in ("tanh", b"tanh")
        return -math.inf, math.inf, ACT_GELU_TANH if tanh else ACT_GELU_ERF
    return None


_GEMM_ONLY = {"HardSwish": ACT_HARDSWISH, "HardSigmoid": ACT_HARDSIGMOID, "Sigmoid": ACT_SIGMOID, "Tanh": ACT_TANH}


def gemm_activation(spec: dict | None) -> Act | None:
    """The Act gemm.h's epilogue applies for a fused activation: fused_activation's clamp and code (the INT8
    kernels' set: ReLU, Clip, Swish with alpha 1, GELU), and HardSwish, HardSigmoid (its alpha and beta), Sigmoid,
    Tanh; None for another (LeakyRelu, Elu, ...: applied after the kernel)."""
    if spec and spec["op"] in _GEMM_ONLY:
        attrs = spec.get("attrs", {})
        return Act(_GEMM_ONLY[spec["op"]], alpha=float(attrs.get("alpha", 0.2)), beta=float(attrs.get("beta", 0.5)))
    fused = fused_activation(spec)
    if fused is None:
        return None
    lo, hi, code = fused
    if (lo, hi, code) == (0.0, math.inf, 0):
        return Act(ACT_RELU)   # one compare and blend a vector where the clamp takes two
    return Act(code, lo > -math.inf or hi < math.inf, lo, hi)


_I64 = ctypes.c_int64
ONE_LINE = 1 << 62   # a call structure's row_width for linear rows: all on one line, row r at r * col_step


class GemmCall(ctypes.Structure):
    """gemm.c's GemmCall, field by field: a GEMM layer's constants, built once at load, so a call converts four
    pointers and two integers (ctypes spends ~0.1 µs an argument). Row r of item p of A starts at element
    p * a_batch + (r / row_width) * line_step + (r % row_width) * col_step."""

    _fields_ = [("b", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                *((name, _I64) for name in ("a_batch", "row_width", "col_step", "line_step", "b_batch", "c_batch")),
                ("act", Act), *((name, _I64) for name in ("k", "n", "io", "ldc"))]   # ldc 0: n


class ConvCall(ctypes.Structure):
    """gemm.c's ConvCall: a direct convolution's constants, built once at load."""

    _fields_ = [("b", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                *((name, _I64) for name in ("h", "w", "c", "kh", "kw", "sh", "sw", "pt", "pl", "oh", "ow")),
                ("act", Act), *((name, _I64) for name in ("cout", "io"))]


def tensor_address(t: torch.Tensor | None) -> int | None:
    """A constant's data pointer for a call structure (None for a missing bias)."""
    return None if t is None else t.data_ptr()


def activation_code(spec: dict | None) -> int:
    """The fused activation of the C kernels with a code only (Winograd, group normalization; activation.h): ReLU,
    Swish (alpha 1); 0 for none or one applied after the kernel. gemm.h's epilogue takes more (gemm_activation)."""
    if not spec:
        return 0
    if spec["op"] == "Relu":
        return ACT_RELU
    return ACT_SWISH if spec["op"] == "Swish" and spec.get("attrs", {}).get("alpha", 1.0) == 1.0 else 0


def pack_weights(b: torch.Tensor) -> torch.Tensor:
    """[..., k, n] -> [..., panels, k, 32] float32, the columns zero-padded to whole panels."""
    k, n = b.shape[-2:]
    panels = -(-n // PANEL)
    padded = torch.zeros((*b.shape[:-1], panels * PANEL), dtype=torch.float32)
    padded[..., :n] = b
    return padded.view(*b.shape[:-1], panels, PANEL).transpose(-3, -2).contiguous()


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The bias zero-padded to whole panels (the micro-kernel reads it 32 at a time)."""
    if bias is None:
        return None
    padded = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    padded[:n] = bias.reshape(-1).float()
    return padded
