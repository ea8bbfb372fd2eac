"""oneDNN primitives of kiln's own (source "onednn"; kiln/native/csrc/onednn.c on oneDNN's C API, from the
`onednn-cpu-gomp` wheel): what every one shares (the call structures' types and activations, the per-shape
executor, the residual's kernel forms) and the INT8 convolution. A primitive is made at load for the planned input
shape, its weights reordered into its kernel's layout then (a dynamic engine's other shapes get theirs on first
sight, reading those weights: ShapePrimitives); a call sets its data pointers and executes. The INT8
convolution takes the layers torch's `qconv2d_pointwise` takes (kiln.tactics.onednn_int8): u8/s8 activations (s8
read as they are, no flip), s8 weights with a scale per output channel, FP32 bias, the INT8 residual as the sum
post-op, ReLU/Clip/HardSwish/Swish, u8/s8 or FP32 out. The floating-point ones: kiln.tactics.onednn_prim_float
and onednn_prim_linear.

Why: torch builds oneDNN's descriptors inside every call (~15-50 us on Zen 4; item 8 of the precision issue asks
for <= 5), and ResNet-50 runs 53 such layers in ~10 ms. Measured per call, Zen 4, 2 threads: a tiny 1x1 INT8
convolution 6.2 us here (2.6 of it the C call, the rest this module's Python) against 30 us through torch;
ResNet-50's 3x3 64-channel layer at 56x56 0.28 against 0.35 ms."""
from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from kiln import native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import table_bytes
from kiln.tactics.base import Kernel, LayerView, has_residual, storage_dtype
from kiln.tactics.gemm_c import tensor_address
from kiln.tactics.lookup_c import table_mapper
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, _output, _scales

TYPES = {"float32": 0, "uint8": 1, "int8": 2, "bfloat16": 3}   # onednn.h's T_*
R_NONE, R_SUM, R_ADD = 0, 1, 2   # onednn.h's R_*: no residual, summed where the output is written, a binary add
ERROR_BYTES = 512
# per layer, the input shapes whose primitives stay made: a dynamic engine sees one per batch size or sequence
# length, each with its JIT-compiled kernel and scratchpad; one made again costs ~0.1-1 ms (no weights reordered)
SHAPES_KEPT = 16
INF = float("inf")

# kiln's fused activation -> (onednn.h's A_*, oneDNN's alpha and beta for it); the ONNX ones oneDNN has
ELTWISE = {
    "Relu": lambda a: (1, 0.0, 0.0),
    "LeakyRelu": lambda a: (1, a.get("alpha", 0.01), 0.0),
    "Clip": lambda a: (2, a.get("min", -INF), a.get("max", INF)),
    "HardSwish": lambda a: (3, 1 / 6, 0.5),
    "Swish": lambda a: (4, a.get("alpha", 1.0), 0.0),
    "Sigmoid": lambda a: (5, 0.0, 0.0),
    "Tanh": lambda a: (6, 0.0, 0.0),
    "HardSigmoid": lambda a: (7, a.get("alpha", 0.2), a.get("beta", 0.5)),
    "Elu": lambda a: (8, a.get("alpha", 1.0), 0.0),
    "Softplus": lambda a: (9, 1.0, 0.0),   # oneDNN's soft_relu: log(1 + exp(alpha x)) / alpha
    "Mish": lambda a: (10, 0.0, 0.0),
    "Gelu": lambda a: (12 if a.get("approximate", "none") == "tanh" else 11, 0.0, 0.0),
}


def eltwise(spec: dict | None) -> tuple[int, float, float] | None:
    """(onednn.h's A_*, alpha, beta) of a fused activation spec; (0, 0, 0) for none, None where oneDNN has none."""
    if not spec:
        return 0, 0.0, 0.0
    make = ELTWISE.get(spec["op"])
    if make is None:
        return None
    act, alpha, beta = make(spec.get("attrs", {}))
    return act, float(alpha), float(beta)


class ConvCall(ctypes.Structure):
    """onednn.c's ConvCall, field by field."""

    _fields_ = [*((f, ctypes.c_int64) for f in ("n", "c", "h", "w", "cout", "kh", "kw", "sh", "sw", "pt", "pl", "pb",
                                                "pr", "dh", "dw", "groups")),
                *((f, ctypes.c_int32) for f in ("x_type", "w_type", "y_type", "r_type", "residual", "act")),
                *((f, ctypes.c_float) for f in ("act_alpha", "act_beta", "x_scale", "y_scale", "r_scale")),
                *((f, ctypes.c_int32) for f in ("x_zp", "y_zp", "r_zp")),
                *((f, ctypes.c_void_p) for f in ("w_scale", "weights", "bias"))]


class OwnPrimitive:
    """Mixin: a tactic on kiln's oneDNN shim (kiln/native/csrc/onednn.c); loaded where oneDNN's C API is missing,
    its layers run on its `library_fallback`, the same layer through torch's oneDNN ops."""

    source = "onednn"
    needs_library = "onednn"


def available() -> bool:
    """Whether oneDNN's C API is installed and kiln's shim over it builds here."""
    return native.buildable("onednn") and native.library("onednn") is not None


class Primitive:
    """One primitive and its packed weights (freed with this object): `kind` "conv" or "matmul", made from `call`;
    reading `share`'s packed weights (another Primitive of the same layer, kept alive by this one) where its kernel
    wants their layout, else a copy of its own."""

    def __init__(self, lib, kind: str, call: ctypes.Structure, share: "Primitive | None" = None):
        error = ctypes.create_string_buffer(ERROR_BYTES)
        create = getattr(lib, f"kiln_dnnl_{kind}_create")
        self.lib, self.handle = lib, create(ctypes.byref(call), share and share.handle, error, ERROR_BYTES)
        self.weights_owner = share if self.handle and lib.kiln_dnnl_shares_weights(self.handle) else None
        if not self.handle:
            what = {"conv": "convolution", "matmul": "matrix product"}[kind]
            raise RuntimeError(f"oneDNN made no {what} for this layer: {error.value.decode() or 'no memory'}")

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.kiln_dnnl_destroy(self.handle)
            self.handle = None


def geometry(layer: LayerView, shape: tuple[int, ...]) -> list[int]:
    """ConvCall's first fields, n to groups, for an input of `shape` (NCHW dims)."""
    a, w = layer.attrs, layer.const_inputs[1]
    return [*shape, w.shape[0], w.shape[2], w.shape[3], *a["strides"], *a["pads"], *a["dilations"], a.get("group", 1)]


def residual_mode(layer: LayerView) -> tuple[int, int]:
    """(onednn.h's R_*, the residual's T_*): summed where the output is written where it has the output's type,
    else added from its own buffer."""
    if not has_residual(layer):
        return R_NONE, -1
    r_type = layer.input_dtypes[3]
    return (R_SUM if r_type == layer.output_dtypes[0] else R_ADD), TYPES[r_type]


def quantized_output(q: dict) -> tuple[int, torch.dtype]:
    """(onednn.h's T_*, torch dtype) of an INT8 layer's output: requantized u8/s8, or FP32 without an output scale."""
    return (TYPES[q["y_dtype"]], INT8_TORCH[q["y_dtype"]]) if "y_scale" in q else (TYPES["float32"], torch.float32)


def float_fields(layer: LayerView, compute_dtype: torch.dtype) -> tuple[list, torch.dtype, torch.dtype, int]:
    """(a floating-point call structure's fields x_type to r_zp, the dtype it reads, the dtype it writes, its R_*)
    for `layer` computing in `compute_dtype`: BF16 reads bf16 and writes what the plan stores, FP32 both FP32."""
    compute = "bfloat16" if compute_dtype == torch.bfloat16 else "float32"
    y_type = layer.output_dtypes[0] if compute == "bfloat16" else "float32"
    residual, r_type = residual_mode(layer)
    fields = [TYPES[compute], TYPES[compute], TYPES[y_type], r_type, residual, *eltwise(layer.attrs.get("activation")),
              1.0, 1.0, 1.0, 0, 0, 0]   # scales and zero points: INT8 only
    return fields, storage_dtype(compute), storage_dtype(y_type), residual


def output_layout(layer: LayerView, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the output's shape, its channel-major strides) for an input of `shape` (NCHW dims)."""
    a, (kh, kw) = layer.attrs, layer.const_inputs[1].shape[2:]
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = a["strides"], a["dilations"], a["pads"]
    h = (shape[2] + pt + pb - (kh - 1) * dh - 1) // sh + 1
    w = (shape[3] + pl + pr - (kw - 1) * dw - 1) // sw + 1
    c = int(layer.const_inputs[1].shape[0])
    return (shape[0], c, h, w), (h * w * c, 1, w * c, c)


class ShapePrimitives:
    """One layer's primitives by input shape (`make_call(shape, any_rows)` gives a call structure, pointing at
    arrays the caller keeps alive): the planned shape's made at once, so packing and refusals happen at load;
    another shape's (a dynamic engine) on first sight, reading the first one's packed weights. Of a convolution the
    SHAPES_KEPT last used are kept; a matrix product whose rows vary (`any_rows`) keeps the first SHAPES_KEPT
    shapes' and runs every other on one product made for any number of rows (oneDNN's kernel for a known count is
    1.1-1.6x faster, but made again for each new count: ~0.5 ms). Not thread-safe: the executor serializes."""

    def __init__(self, lib, kind: str, make_call, out_layout, planned: tuple[int, ...], any_rows: bool):
        self.lib, self.kind, self.make_call, self.out_layout, self.any_rows = lib, kind, make_call, out_layout, any_rows
        self.planned = planned
        self.first = Primitive(lib, kind, make_call(planned, False))   # kept: its packed weights are the others'
        self.rows_free: list[Primitive | None] = []   # the any-rows product once needed (None: oneDNN refused it)
        # per input shape, least recently used first: the primitive, its handle, the rows it runs on, and the
        # output's shape and strides
        self.by_shape: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self.last: tuple = ((), None)   # the last call's (shape, entry): a run of one shape skips the LRU's upkeep
        self.get(planned)

    def get(self, shape: tuple[int, ...]) -> tuple[Primitive, int, int, tuple[int, ...], tuple[int, ...]]:
        if shape != self.last[0]:
            made = self.by_shape.get(shape)
            if made is None:
                made = self._new(shape)
            else:
                self.by_shape.move_to_end(shape)
            self.last = (shape, made)
        return self.last[1]

    def _new(self, shape: tuple[int, ...]) -> tuple[Primitive, int, int, tuple[int, ...], tuple[int, ...]]:
        """The entry of a shape first seen (or evicted since): the any-rows product's past SHAPES_KEPT row counts,
        else a primitive of its own, kept and the least recently used dropped past SHAPES_KEPT."""
        if self.any_rows and len(self.by_shape) >= SHAPES_KEPT and not self.rows_free:
            try:
                self.rows_free.append(Primitive(self.lib, self.kind, self.make_call(shape, True), self.first))
            except RuntimeError:   # no kernel for any number of rows: shapes replace each other instead
                self.rows_free.append(None)
        if self.rows_free and self.rows_free[0] is not None:
            return (self.rows_free[0], self.rows_free[0].handle, math.prod(shape[:-1]), *self.out_layout(shape))
        prim = self.first if shape == self.planned else \
            Primitive(self.lib, self.kind, self.make_call(shape, False), self.first)
        self.by_shape[shape] = made = (prim, prim.handle, math.prod(shape[:-1]), *self.out_layout(shape))
        if len(self.by_shape) > SHAPES_KEPT:
            self.by_shape.popitem(last=False)
        return made


@dataclass(frozen=True)
class ChainLink:
    """A primitive kernel as kiln.runtime.chains runs it inside a run of such layers, all in one C call: its
    primitives by input shape, the lock its calls hold, the dtype it reads (None: its input's, as it is) in
    `memory_format`, the dtype it writes, how its residual (argument 3) joins (R_*), and an INT8 output's table
    (256 bytes its output is mapped through in place, then read as `out_dtype`; None: none)."""

    primitives: ShapePrimitives
    lock: threading.Lock
    x_dtype: torch.dtype | None
    out_dtype: torch.dtype
    memory_format: torch.memory_format
    residual: int = R_NONE
    table: torch.Tensor | None = None

    @property
    def second_at(self) -> int | None:
        """The argument it reads besides its input: the residual (3), where it has one."""
        return None if self.residual == R_NONE else 3


def executor(layer: LayerView, kind: str, make_call, out_layout, out_dtype: torch.dtype,
             x_dtype: torch.dtype | None = None, memory_format=torch.channels_last, any_rows: bool = False):
    """execute(x, y=None, r=None) -> y: `layer`'s primitive (`kind`, Primitive's; one per input shape,
    ShapePrimitives' with `make_call` and `any_rows`) on `x` (made `memory_format` contiguous, cast to `x_dtype`
    where given) into `y` (a new tensor of `out_dtype` where None, laid out as `out_layout(shape)` gives it,
    (shape, strides); holding the residual where it is summed in place), `r` a residual read from its own buffer."""
    lib = native.library("onednn")
    primitives = ShapePrimitives(lib, kind, make_call, out_layout, tuple(layer.input_shapes[0]), any_rows)
    lock = threading.Lock()   # one call at a time per primitive: its scratchpad is its own
    run_c = lib.kiln_dnnl_run

    def execute(x: torch.Tensor, y: torch.Tensor | None = None, r: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous(memory_format=memory_format) if x_dtype is None or x.dtype == x_dtype else \
            x.to(x_dtype, memory_format=memory_format)   # (.to costs ~1 us even where it has nothing to do)
        r = None if r is None else r.contiguous(memory_format=memory_format)
        with lock:
            _, handle, rows, shape, strides = primitives.get(x.shape)   # torch.Size: a tuple, hashed as one
            y = torch.empty_strided(shape, strides, dtype=out_dtype) if y is None else y
            status = run_c(handle, rows, x.data_ptr(), y.data_ptr(), None if r is None else r.data_ptr())
        if status:
            raise RuntimeError(f"oneDNN's {kind} primitive failed (status {status})")
        return y
    execute.chain_link = ChainLink(primitives, lock, x_dtype, out_dtype, memory_format)
    return execute


def summing_kernel(execute, table: dict | None, residual: int, memory_format=torch.channels_last) -> Kernel:
    """The kernel around `execute` (executor's): the residual summed in place (`run.into_input`) or in a copy, or
    added from its own buffer, then the INT8 output mapped through `table` (a layer's "out_table"; None: none). It
    carries its ChainLink."""
    kernel = _summing(execute, None if table is None else table_mapper(table), residual, memory_format)
    link = replace(execute.chain_link, residual=residual)
    if table is not None:
        link = replace(link, out_dtype=INT8_TORCH[table["dtype"]], table=table_bytes(table))
    kernel.chain_link = link
    return kernel


def _summing(execute, finish, residual: int, memory_format) -> Kernel:
    last = memory_format
    if residual == R_NONE:
        return (lambda xs: [execute(xs[0])]) if finish is None else (lambda xs: [finish(execute(xs[0]))])
    finish = finish or (lambda y: y)
    if residual == R_ADD:
        return lambda xs: [finish(execute(xs[0], None, xs[3]))]

    def run_into_residual(xs):
        """The residual as the sum post-op, accumulated in its own (dead) buffer."""
        accum = xs[3] if xs[3].is_contiguous(memory_format=last) else xs[3].contiguous(memory_format=last)
        return [finish(execute(xs[0], accum))]

    def run(xs):
        return run_into_residual([xs[0], None, None, xs[3].clone(memory_format=last)])
    run.into_input = (3, run_into_residual)
    return run


class PrimitiveInt8ConvTactic(OwnPrimitive, OneDnnInt8ConvTactic):
    name = "onednn.qconv2d_primitive"
    library_fallback = OneDnnInt8ConvTactic()

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and available()

    def prepare(self, layer: LayerView) -> Kernel:
        q = layer.attrs["quant"]
        w, scales = layer.const_inputs[1].contiguous(), _scales(layer)[0].contiguous()
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.float().contiguous()
        y_scale, y_zp, _ = _output(layer)
        y_type, out_dtype = quantized_output(q)
        # the INT8 residual is always summed: oneDNN's sum post-op reads u8 into s8 and back (one byte each)
        residual = R_SUM if has_residual(layer) else R_NONE
        r_type = TYPES[layer.input_dtypes[3]] if residual else -1
        act = eltwise(layer.attrs.get("activation"))

        def make_call(shape: tuple[int, ...], _any_rows: bool) -> ConvCall:
            return ConvCall(*geometry(layer, shape), TYPES[q["x_dtype"]], TYPES["int8"], y_type, r_type, residual,
                            *act, float(q["x_scale"]), y_scale, float(q.get("r_scale", 1.0)), int(q["x_zero_point"]),
                            y_zp, int(q.get("r_zero_point", 0)), scales.data_ptr(), w.data_ptr(),
                            tensor_address(bias))

        execute = executor(layer, "conv", make_call, lambda shape: output_layout(layer, shape), out_dtype)
        return summing_kernel(execute, layer.attrs.get("out_table"), residual)
