"""Resize in C (kiln/native/csrc/resize.c), from tables that kiln.ops' own Resize rule computes at load (every
coordinate transformation mode but tf_crop_and_resize; batch and channels unchanged). Nearest: on channel-major
(NHWC) activations every output pixel is one copy of an input pixel's channels, chosen by index tables. Linear and
cubic (antialiased too): every output pixel sums its rows x cols taps of input pixels with their weights, FP32
accumulation, on channel-major maps or, one channel at a time, on row-major ones.

Like the pooling kernels it takes the producer's layout: a row-major input runs torch's kernel. torch's
nearest upsampling of a channels-last map took 0.7-1.0 ms for YOLOv8n's two 2x upsamples (256 x 40 x 40,
128 x 80 x 80), a memory copy's work.
"""
from __future__ import annotations

import torch

from kiln import native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.norm_resize import resize, resize_taps
from kiln.ops.registry import host_value
from kiln.tactics.base import ANY, HWC, LINEAR, MEMORY_ORDER, STORED_FLOATS, Bf16Storage, Kernel, LayerView, \
    requantizing_params, storage_dtype
from kiln.tactics.views import row_step

RESIZE_TACTIC = "kiln.resize_nearest_nhwc"
INTERPOLATE_TACTIC = "kiln.resize_interpolate"


def _spatial_taps(layer: LayerView):
    """kiln.ops' Resize taps (indices, weights or None) of H and W for a 4-D layer whose roi, scales and sizes are
    constants and whose batch and channels stay as they are; None where these kernels do not apply."""
    x = layer.input_shapes[0]
    given = [i for i in (1, 2, 3) if i < len(layer.input_shapes) and layer.input_shapes[i] is not None]
    if x is None or len(x) != 4 or any(i not in layer.const_inputs for i in given):
        return None
    taps = resize_taps(layer.attrs, list(x), *(host_value(layer.const_inputs.get(i)) for i in (1, 2, 3)))
    if taps is None or any(idx.shape[1] != 1 or not torch.equal(idx[:, 0], torch.arange(x[a]))
                           for a, (idx, _) in enumerate(taps[:2])):
        return None   # batch or channels resampled too
    return taps[2:]


def _tables(layer: LayerView) -> list[torch.Tensor] | None:
    """Nearest: per spatial axis, the input index of each output index; None where this kernel does not apply."""
    taps = _spatial_taps(layer) if layer.attrs.get("mode", "nearest") == "nearest" else None
    return None if taps is None else [idx[:, 0].contiguous() for idx, _ in taps]


class NhwcResizeTactic:
    """Nearest Resize by copies of whole pixels: FP32, or INT8 bytes where the quantization pass moved a nearest
    Resize's Q/DQ past it (a copy commutes with quantization, as MaxPool does)."""

    name = RESIZE_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32", "uint8", "int8")

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Resize" or layer.domain not in ("", "ai.onnx") or len(layer.output_dtypes) != 1:
            return False
        if layer.input_dtypes[0] not in self.stored_types or layer.output_dtypes[0] not in self.stored_types:
            return False
        if layer.output_dtypes[0] != layer.input_dtypes[0] and INT8_TORCH.keys() & {*layer.input_dtypes[:1],
                                                                                   *layer.output_dtypes}:
            return False   # bytes are copied as they are
        if layer.input_dynamic and layer.input_dynamic[0]:
            return False
        return native.available() and self.tables_apply(layer)

    def tables_apply(self, layer: LayerView) -> bool:
        return _tables(layer) is not None

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC if input_formats and input_formats[0] == HWC else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("resize")
        n, c, h, w = layer.input_shapes[0]
        rows, cols = _tables(layer)
        oh, ow = len(rows), len(cols)
        host = {i: host_value(layer.const_inputs.get(i)) for i in (1, 2, 3)}
        last = torch.channels_last
        dtype = INT8_TORCH.get(layer.output_dtypes[0]) or storage_dtype(layer.output_dtypes[0])
        pixel_bytes = c * dtype.itemsize

        def into(x, y, step):
            lib.kiln_resize_nearest(x.data_ptr(), y.data_ptr(), n, h, w, pixel_bytes, oh, ow, rows.data_ptr(),
                                    cols.data_ptr(), step * dtype.itemsize)

        def run(xs):
            x = xs[0] if xs[0].dtype == dtype else xs[0].to(dtype)   # a move: converted once, before it
            if not x.is_contiguous(memory_format=last):   # row-major input: torch's kernel, same layout out
                return resize(layer.attrs, [x, host[1], host[2], host[3]][:len(xs)])
            y = torch.empty((n, c, oh, ow), dtype=dtype, memory_format=last)
            into(x, y, c)
            return [y]

        def write_into(xs, out):
            """Pixels straight into `out` where it is channel-major with wider pixels (a Concat's channel slice)."""
            x = xs[0] if xs[0].dtype == dtype else xs[0].to(dtype)
            fits = x.is_contiguous(memory_format=last) and out.dtype == dtype and tuple(out.shape) == (n, c, oh, ow)
            step = row_step(out, MEMORY_ORDER[HWC], 3) if fits else None
            if step is None:
                out.copy_(run(xs)[0])
            else:
                into(x, out, step)
        run.constants = (rows, cols)   # read through raw pointers
        run.write_into = write_into
        return run


class NhwcResizeBf16Tactic(Bf16Storage, NhwcResizeTactic):
    """Granted BF16: the copies move bf16 pixels where the plan stores them so (exact: a nearest Resize only moves
    data), so YOLOv8's upsamples between bf16 layers stay bf16."""

    name = RESIZE_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})


def _interpolation_tables(layer: LayerView) -> tuple[torch.Tensor, ...] | None:
    """Linear and cubic: (rows, row weights, cols, col weights), input indices [out, taps] (int64) and FP32 weights
    per spatial axis; None where this kernel does not apply."""
    taps = _spatial_taps(layer) if layer.attrs.get("mode", "nearest") != "nearest" else None
    if taps is None:
        return None
    (rows, row_weights), (cols, col_weights) = (
        (idx.contiguous(), torch.ones(idx.shape, dtype=torch.float32) if w is None else w.float().contiguous())
        for idx, w in taps)
    return rows, row_weights, cols, col_weights


class InterpolateResizeTactic(NhwcResizeTactic):
    """Linear and cubic Resize: channel-major maps in C with the channels as the vector, row-major ones as N*C
    one-channel maps; the output keeps the input's layout. FP32 only: an interpolation of INT8 bytes is not a copy
    (its rounding and saturation are torch's reference kernel's)."""

    name = INTERPOLATE_TACTIC
    stored_types = ("float32",)

    def tables_apply(self, layer: LayerView) -> bool:
        return _interpolation_tables(layer) is not None

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("resize")
        n, c, h, w = layer.input_shapes[0]
        tables = rows, row_weights, cols, col_weights = _interpolation_tables(layer)
        oh, ow = rows.shape[0], cols.shape[0]
        last, dtype = torch.channels_last, storage_dtype(layer.output_dtypes[0])
        pointers = (rows.shape[1], rows.data_ptr(), row_weights.data_ptr(), cols.shape[1], cols.data_ptr(),
                    col_weights.data_ptr())

        def run(xs):
            x = xs[0]
            channel_major = x.is_contiguous(memory_format=last) and c > 1
            if not channel_major:
                x = x.contiguous()
            layout = last if channel_major else torch.contiguous_format
            y = torch.empty((n, c, oh, ow), dtype=dtype, memory_format=layout)
            images, channels = (n, c) if channel_major else (n * c, 1)
            io = int(x.dtype == torch.bfloat16) | 2 * int(dtype == torch.bfloat16)
            lib.kiln_resize_taps(x.data_ptr(), y.data_ptr(), images, h, w, channels, oh, ow, *pointers, io)
            return [y]
        run.constants = tables   # read through raw pointers
        return run


class InterpolateResizeBf16Tactic(Bf16Storage, InterpolateResizeTactic):
    """Granted BF16: reads and writes bf16 where the plan stores it so, sums in FP32 (one rounding at the output),
    so a segmentation head's or FPN's bilinear upsample between bf16 layers stays bf16."""

    name = INTERPOLATE_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})


class QuantizedResizeTactic:
    """kiln's QResize (DequantizeLinear -> linear or cubic Resize -> QuantizeLinear, kiln.passes.qpool) on
    channel-major INT8 maps: the interpolation tables of kiln.resize_interpolate, the centred taps summed in FP32,
    each output quantized as the Q node would."""

    name = INTERPOLATE_TACTIC + "_int8"
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        q = layer.attrs.get("quant", {})
        if layer.op_type != "QResize" or layer.domain != "kiln" or len(layer.output_dtypes) != 1:
            return False
        if q.get("x_dtype") not in INT8_TORCH or q.get("y_dtype") not in INT8_TORCH:
            return False
        if any(layer.input_dynamic):   # the tap tables are built for one input size
            return False
        return native.available() and _interpolation_tables(layer) is not None

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] + [ANY] * (len(layer.input_shapes) - 1)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("resize")
        n, c, h, w = layer.input_shapes[0]
        q = layer.attrs["quant"]
        tables = rows, row_weights, cols, col_weights = _interpolation_tables(layer)
        params = requantizing_params(q)
        oh, ow, dtype = rows.shape[0], cols.shape[0], INT8_TORCH[q["y_dtype"]]
        pointers = (rows.shape[1], rows.data_ptr(), row_weights.data_ptr(), cols.shape[1], cols.data_ptr(),
                    col_weights.data_ptr(), params.data_ptr())

        def run(xs):
            x = xs[0].contiguous(memory_format=torch.channels_last)
            y = torch.empty((n, c, oh, ow), dtype=dtype, memory_format=torch.channels_last)
            lib.kiln_resize_taps_q8(x.data_ptr(), y.data_ptr(), n, h, w, c, oh, ow, *pointers)
            return [y]
        run.constants = (*tables, params)   # read through raw pointers
        return run
