"""Pooling on channel-major (NHWC) activations in C (kiln/native/csrc/pool.c): 2-D MaxPool (any kernel, stride,
dilation, padding, ceil mode; FP32, u8, s8 or bf16) and AveragePool (the same windows, count_include_pad either way;
FP32 or bf16), and GlobalAveragePool / GlobalMaxPool and ReduceMean / ReduceMax
over the spatial axes (FP32 or bf16, either layout), vectorized over channels, OpenMP over output rows; and the
INT8 average pools of kiln.passes.qpool (channel-major, integer window sums, one rounding to the output scale).

MaxPool and the global pools take their input in whatever layout the producer wrote, so choosing them never adds
Reformat layers: a channel-major input runs the C loops, a channel-planar one (e.g. between INT8 layers) the global
pool's row loop, or MaxPool's loop between two transposes (torch's channel-planar MaxPool is 6x slower: 2.45 against
0.39 ms for 3x3 over 16x112x112, transposes included). AveragePool takes channel-major input.

torch's channels-last pooling spends most of its time outside the loop that matters on small maps: ResNet-50's
stem MaxPool takes 0.22 ms there and its global average pool 0.10 ms, against 0.09 and 0.03 ms in OpenVINO.
NaN propagates as in torch (a window holding NaN gives NaN); averages accumulate in double.
"""
from __future__ import annotations

import dataclasses

import torch

from kiln import native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.nn import pool_output_size, reduce_axes
from kiln.tactics.base import ANY, HWC, LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, batch_dynamic_only, \
    bf16_io, requantizing_params, storage_dtype

POOL_TACTIC = "kiln.pool2d_nhwc"
QPOOL_TACTIC = "kiln.pool2d_nhwc_int8"
MAXPOOL_TYPES = {"float32": ("kiln_maxpool", torch.float32), "uint8": ("kiln_maxpool_u8", torch.uint8),
                 "int8": ("kiln_maxpool_s8", torch.int8),
                 "bfloat16": ("kiln_maxpool_bf16", torch.bfloat16)}   # NhwcPoolBf16Tactic's
GLOBAL_MEAN = {"GlobalAveragePool": 1, "GlobalMaxPool": 0, "ReduceMean": 1, "ReduceMax": 0}   # op -> averages?
WINDOW_POOLS = ("MaxPool", "AveragePool")
POOL_OPS = (*WINDOW_POOLS, *GLOBAL_MEAN)


def global_pool(layer: LayerView) -> bool:
    """A global pool, or a ReduceMean/ReduceMax over exactly the spatial axes of a 4-D tensor (how torch.onnx's
    dynamo exporter writes adaptive_avg_pool2d(x, 1), and Keras models write global pooling)."""
    if layer.op_type.startswith("Global"):
        return True
    axes = layer.const_inputs.get(1)   # opset 18's axes input: known at build time only as a constant
    if len(layer.input_shapes) > 1 and axes is None:
        return False
    axes = reduce_axes(layer.attrs, [None, None if axes is None else axes.reshape(-1).tolist()], 4)
    return axes is not None and sorted(axes) == [2, 3]


@dataclasses.dataclass(frozen=True)
class Window:
    """A 2-D window pool's geometry: channels and input size (the batch is read per call), kernel, strides,
    dilations, pads (top, left, bottom, right) and the output size they give."""

    c: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    pt: int
    pl: int
    pb: int
    pr: int
    oh: int
    ow: int

    @classmethod
    def of(cls, layer: LayerView) -> "Window":
        a = layer.attrs
        _, c, h, w = layer.input_shapes[0]
        kh, kw = a["kernel_shape"]
        (sh, sw), (dh, dw) = a.get("strides") or [1, 1], a.get("dilations") or [1, 1]
        pt, pl, pb, pr = a.get("pads") or [0, 0, 0, 0]
        ceil = bool(a.get("ceil_mode", 0))
        return cls(c, h, w, kh, kw, sh, sw, dh, dw, pt, pl, pb, pr, pool_output_size(h, kh, sh, dh, pt, pb, ceil),
                   pool_output_size(w, kw, sw, dw, pl, pr, ceil))


class NhwcPoolTactic:
    name = POOL_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32", "uint8", "int8")

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type not in POOL_OPS or layer.domain not in ("", "ai.onnx"):
            return False
        x = layer.input_shapes[0]
        if x is None or len(x) != 4 or layer.input_dtypes[0] not in self.stored_types or \
                layer.output_dtypes[0] not in self.stored_types or len(layer.output_dtypes) != 1:
            return False
        if not self._types_ok(layer) or not batch_dynamic_only(layer):   # the batch is read per call
            return False
        if layer.op_type not in WINDOW_POOLS:
            return global_pool(layer) and native.available()
        if len(layer.attrs.get("kernel_shape") or ()) != 2 or \
                layer.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "", b"NOTSET"):
            return False
        return native.available()

    def _types_ok(self, layer: LayerView) -> bool:
        """FP32 in and out; MaxPool also on INT8 tensors (the maximum commutes with quantization)."""
        same = layer.output_dtypes[0] == layer.input_dtypes[0]
        return same and (layer.op_type == "MaxPool" or layer.input_dtypes[0] == "float32")

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC if layer.op_type == "AveragePool" else ANY] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC if HWC in input_formats else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        if layer.op_type == "AveragePool":
            return self._prepare_avgpool(layer)
        if layer.op_type != "MaxPool":
            return self._prepare_global(layer)
        return self._prepare_maxpool(layer)

    @staticmethod
    def _prepare_avgpool(layer: LayerView) -> Kernel:
        lib = native.library("pool")
        win = Window.of(layer)
        c, oh, ow = win.c, win.oh, win.ow
        geometry = torch.tensor([win.h, win.w, c, win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.pt, win.pl,
                                 win.pb, win.pr, int(layer.attrs.get("count_include_pad", 0))], dtype=torch.int64)
        io = bf16_io(layer)
        dtype = storage_dtype(layer.output_dtypes[0])
        last = torch.channels_last

        def run(xs):
            x = xs[0].contiguous(memory_format=last)   # channel-planar input: one transpose (input_formats: HWC)
            y = torch.empty((x.shape[0], c, oh, ow), dtype=dtype, memory_format=last)
            lib.kiln_avgpool(x.data_ptr(), y.data_ptr(), x.shape[0], oh, ow, geometry.data_ptr(), io)
            return [y]
        run.constants = (geometry,)   # read through a raw pointer
        return run

    @staticmethod
    def _prepare_global(layer: LayerView) -> Kernel:
        lib = native.library("pool")
        _, c, h, w = layer.input_shapes[0]   # the batch: per call
        mean = GLOBAL_MEAN[layer.op_type]
        keep = layer.op_type.startswith("Global") or bool(layer.attrs.get("keepdims", 1))
        io = bf16_io(layer)
        dtype = storage_dtype(layer.output_dtypes[0])
        last = torch.channels_last

        def run_global(xs):
            x = xs[0]
            planar = not x.is_contiguous(memory_format=last)   # a 1x1 map is both: either reading serves
            if planar:
                x = x.contiguous()
            n = x.shape[0]
            y = torch.empty((n, c, 1, 1), dtype=dtype, memory_format=last) if keep else torch.empty((n, c), dtype=dtype)
            lib.kiln_global_pool(x.data_ptr(), y.data_ptr(), n, h * w, c, mean, io, int(planar))
            return [y]
        return run_global

    @staticmethod
    def _prepare_maxpool(layer: LayerView) -> Kernel:
        lib = native.library("pool")
        win = Window.of(layer)
        c, h, w, oh, ow = win.c, win.h, win.w, win.oh, win.ow
        kh, kw, sh, sw, dh, dw, pt, pl = win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.pt, win.pl
        entry, dtype = MAXPOOL_TYPES[layer.input_dtypes[0]]
        pool = getattr(lib, entry)
        last = torch.channels_last

        def run(xs):
            x = xs[0]
            planar = not x.is_contiguous(memory_format=last)
            if planar:   # transposed in and out: torch's channel-planar MaxPool is 6x slower (3x3, 16x112x112)
                x = x.contiguous(memory_format=last)
            y = torch.empty((x.shape[0], c, oh, ow), dtype=dtype, memory_format=last)
            pool(x.data_ptr(), y.data_ptr(), x.shape[0], h, w, c, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl)
            return [y.contiguous() if planar else y]
        return run


class NhwcPoolBf16Tactic(Bf16Storage, NhwcPoolTactic):
    """Pools granted BF16, on tensors as the plan stores them, so a pool between BF16 layers (ResNet's stem, YOLO's
    SPPF, a squeeze-excite block's average) keeps their tensors bf16. MaxPool is exact: the maximum of bf16 values
    is one of them, and an FP32 input rounded to a bf16 output first gives the rounded FP32 maximum (rounding is
    monotonic). The global pools read either type and accumulate in double; a bf16 output rounds the result once."""

    name = POOL_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})

    def _types_ok(self, layer: LayerView) -> bool:
        return True   # any combination of FP32 and bf16: the global pools read and write both, MaxPool converts

    def prepare(self, layer: LayerView) -> Kernel:
        if layer.op_type != "MaxPool" or layer.input_dtypes[0] == layer.output_dtypes[0]:
            return super().prepare(layer)
        typed = dataclasses.replace(layer, input_dtypes=(layer.output_dtypes[0], *layer.input_dtypes[1:]))
        kernel = super().prepare(typed)   # the kernel reads its output's type: the input is converted first
        dtype = storage_dtype(layer.output_dtypes[0])
        return lambda xs: kernel([xs[0].to(dtype), *xs[1:]])


class QuantizedPoolTactic:
    """kiln's QAveragePool (DequantizeLinear -> AveragePool / GlobalAveragePool / ReduceMean over H and W ->
    QuantizeLinear, kiln.passes.qpool): INT8 in and out on channel-major maps, the taps' bytes summed in integers and
    the mean rounded once to the output scale, as QuantizeLinear rounds. The batch is read per call."""

    name = QPOOL_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "QAveragePool" or layer.domain != "kiln" or len(layer.output_dtypes) != 1:
            return False
        x, q, pool = layer.input_shapes[0], layer.attrs.get("quant", {}), layer.attrs.get("pool")
        if x is None or len(x) != 4 or q.get("x_dtype") not in INT8_TORCH or q.get("y_dtype") not in INT8_TORCH:
            return False
        if not batch_dynamic_only(layer):
            return False
        if pool == "AveragePool":
            shaped = len(layer.attrs.get("kernel_shape") or ()) == 2 and \
                layer.attrs.get("auto_pad", "NOTSET") in ("NOTSET", "", b"NOTSET")
        else:
            shaped = pool in GLOBAL_MEAN and global_pool(dataclasses.replace(layer, op_type=pool, domain=""))
        return shaped and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] + [ANY] * (len(layer.input_shapes) - 1)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("pool")
        q, last = layer.attrs["quant"], torch.channels_last
        params = requantizing_params(q)
        dtype = INT8_TORCH[q["y_dtype"]]
        _, c, h, w = layer.input_shapes[0]
        if layer.attrs["pool"] == "AveragePool":
            win = Window.of(layer)
            geometry = torch.tensor([win.h, win.w, c, win.kh, win.kw, win.sh, win.sw, win.dh, win.dw, win.pt, win.pl,
                                     win.pb, win.pr, int(layer.attrs.get("count_include_pad", 0))], dtype=torch.int64)

            def run(xs):
                x = xs[0].contiguous(memory_format=last)
                y = torch.empty((x.shape[0], c, win.oh, win.ow), dtype=dtype, memory_format=last)
                lib.kiln_avgpool_q8(x.data_ptr(), y.data_ptr(), x.shape[0], win.oh, win.ow, geometry.data_ptr(),
                                    params.data_ptr())
                return [y]
            run.constants = (geometry, params)   # read through raw pointers
            return run
        keep = layer.attrs["pool"] == "GlobalAveragePool" or bool(layer.attrs.get("keepdims", 1))

        def run_global(xs):
            x = xs[0].contiguous(memory_format=last)
            n = x.shape[0]
            y = torch.empty((n, c, 1, 1), dtype=dtype, memory_format=last) if keep else torch.empty((n, c), dtype=dtype)
            lib.kiln_global_avgpool_q8(x.data_ptr(), y.data_ptr(), n, h * w, c, params.data_ptr())
            return [y]
        run_global.constants = (params,)
        return run_global
