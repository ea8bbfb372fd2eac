"""oneDNN INT8 convolution as a primitive of kiln's own (source "onednn"): made once per input shape at load,
weights reordered into its kernel's layout then, each call only two data pointers and an execute
(kiln/native/csrc/onednn.c on oneDNN's C API, from the `onednn-cpu-gomp` wheel). The same layers as torch's
`qconv2d_pointwise` (kiln.tactics.onednn_int8): u8/s8 activations (s8 read as they are, no flip), s8 weights with
a scale per output channel, FP32 bias, the INT8 residual as the sum post-op, ReLU/Clip/HardSwish/Swish, u8/s8 or
FP32 out.

Why: torch builds oneDNN's descriptors inside every call (~30-40 us on Zen 4, item 8 of the precision issue asks
for <= 5), and ResNet-50 runs 53 such layers in ~10 ms. Measured per call, Zen 4, 2 threads: a tiny 1x1
convolution 6.2 us here (2.6 of it the C call, the rest this module's Python) against 30 us through torch;
ResNet-50's 3x3 64-channel layer at 56x56 0.28 against 0.35 ms."""
from __future__ import annotations

import ctypes
import threading

import torch

from kiln import native
from kiln.tactics.base import Kernel, LayerView, has_residual
from kiln.tactics.lookup_c import table_mapper
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, _output, _scales

TYPES = {"float32": 0, "uint8": 1, "int8": 2}   # onednn.c's T_*
ACTIVATIONS = {None: 0, "Relu": 1, "Clip": 2, "HardSwish": 3, "Swish": 4}   # onednn.c's A_*
ERROR_BYTES = 512


class ConvCall(ctypes.Structure):
    """onednn.c's ConvCall, field by field."""

    _fields_ = [*((f, ctypes.c_int64) for f in ("n", "c", "h", "w", "cout", "kh", "kw", "sh", "sw", "pt", "pl", "pb",
                                                "pr", "dh", "dw", "groups")),
                *((f, ctypes.c_int32) for f in ("x_type", "y_type", "r_type", "act")),
                *((f, ctypes.c_float) for f in ("act_lo", "act_hi", "x_scale", "y_scale", "r_scale")),
                *((f, ctypes.c_int32) for f in ("x_zp", "y_zp", "r_zp", "pad_")),
                *((f, ctypes.c_void_p) for f in ("w_scale", "weights", "bias"))]


def available() -> bool:
    """Whether oneDNN's C API is installed and kiln's shim over it builds here."""
    return native.buildable("onednn") and native.library("onednn") is not None


class Primitive:
    """One convolution primitive and its packed weights (freed with this object)."""

    def __init__(self, lib, call: ConvCall):
        error = ctypes.create_string_buffer(ERROR_BYTES)
        self.lib, self.handle = lib, lib.kiln_dnnl_conv_create(ctypes.byref(call), error, ERROR_BYTES)
        if not self.handle:
            raise RuntimeError(f"oneDNN made no INT8 convolution for this layer: {error.value.decode() or 'no memory'}")

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.kiln_dnnl_conv_destroy(self.handle)
            self.handle = None


def conv_call(layer: LayerView, shape: tuple[int, ...], consts: dict) -> ConvCall:
    """The ConvCall of `layer` for an input of `shape` (NCHW dims); `consts` keeps the arrays it points at alive."""
    a, q = layer.attrs, layer.attrs["quant"]
    w = consts.setdefault("w", layer.const_inputs[1].contiguous())
    scales = consts.setdefault("scales", _scales(layer)[0].contiguous())
    bias = layer.const_inputs.get(2)
    if bias is not None:
        bias = consts.setdefault("bias", bias.float().contiguous())
    y_scale, y_zp, _ = _output(layer)
    spec = a.get("activation") or {}
    pt, pl, pb, pr = a["pads"]
    n, c, h, w_in = shape
    return ConvCall(n, c, h, w_in, w.shape[0], w.shape[2], w.shape[3], *a["strides"], pt, pl, pb, pr,
                    *a["dilations"], a.get("group", 1), TYPES[q["x_dtype"]],
                    TYPES[q["y_dtype"]] if "y_scale" in q else 0,
                    TYPES[layer.input_dtypes[3]] if has_residual(layer) else -1, ACTIVATIONS[spec.get("op")],
                    float(spec.get("attrs", {}).get("min", float("-inf"))),
                    float(spec.get("attrs", {}).get("max", float("inf"))), float(q["x_scale"]), y_scale,
                    float(q.get("r_scale", 1.0)), int(q["x_zero_point"]), y_zp, int(q.get("r_zero_point", 0)), 0,
                    scales.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr())


def output_shape(layer: LayerView, shape: tuple[int, ...]) -> tuple[int, ...]:
    a, (kh, kw) = layer.attrs, layer.const_inputs[1].shape[2:]
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = a["strides"], a["dilations"], a["pads"]
    oh = (shape[2] + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (shape[3] + pl + pr - (kw - 1) * dw - 1) // sw + 1
    return shape[0], int(layer.const_inputs[1].shape[0]), oh, ow


class PrimitiveInt8ConvTactic(OneDnnInt8ConvTactic):
    name = "onednn.qconv2d_primitive"
    source = "onednn"
    needs_library = "onednn"   # loaded where oneDNN's C API is missing, the layer runs on the tactic below
    library_fallback = OneDnnInt8ConvTactic()

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and available()

    def prepare(self, layer: LayerView) -> Kernel:
        lib, last = native.library("onednn"), torch.channels_last
        q = layer.attrs["quant"]
        out_dtype = {"uint8": torch.uint8, "int8": torch.int8}[q["y_dtype"]] if "y_scale" in q else torch.float32
        # per input shape: the primitive, its handle, and the output's shape and channel-major strides
        by_shape: dict[tuple[int, ...], tuple[Primitive, int, tuple[int, ...], tuple[int, ...]]] = {}
        lock = threading.Lock()   # one call at a time per primitive: its scratchpad is its own
        run_c = lib.kiln_dnnl_conv_run

        def primitive(shape: tuple[int, ...]):
            if shape not in by_shape:
                consts: dict = {}   # alive until oneDNN has copied the weights, scales and bias in
                conv, (n, c, h, w) = Primitive(lib, conv_call(layer, shape, consts)), output_shape(layer, shape)
                by_shape[shape] = conv, conv.handle, (n, c, h, w), (h * w * c, 1, w * c, c)
            return by_shape[shape]

        primitive(tuple(layer.input_shapes[0]))   # made at load: packing and refusals happen here
        table = layer.attrs.get("out_table")
        mapped = table_mapper(table)

        def execute(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
            x = x.contiguous(memory_format=last)
            with lock:
                _, handle, shape, strides = primitive(tuple(x.shape))
                y = torch.empty_strided(shape, strides, dtype=out_dtype) if y is None else y
                status = run_c(handle, x.data_ptr(), y.data_ptr())
            if status:
                raise RuntimeError(f"oneDNN's INT8 convolution failed (status {status})")
            return mapped(y) if table else y

        if not has_residual(layer):
            def run(xs):
                return [execute(xs[0], None)]
            return run

        def run_into_residual(xs):
            """The residual as the sum post-op, accumulated in its own (dead) INT8 buffer."""
            accum = xs[3] if xs[3].is_contiguous(memory_format=last) else xs[3].contiguous(memory_format=last)
            return [execute(xs[0], accum)]

        def run(xs):
            return run_into_residual([xs[0], None, None, xs[3].clone(memory_format=last)])
        run.into_input = (3, run_into_residual)
        return run
