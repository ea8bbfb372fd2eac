"""Generated code for fused pointwise layers (tactic source "codegen"): each PointWise program becomes one C
loop nest (kiln.tactics.pointwise_c), compiled by kiln.native for this CPU (vectorized libm, OpenMP on torch's
own thread pool) and cached per source, compiler and CPU, so loading an engine again only maps the library.
Without a C compiler the source is unavailable, and engines built elsewhere run these layers on torch's
reference kernels (kiln.runtime.prepare)."""
from __future__ import annotations

import collections
import ctypes
import dataclasses

import numpy as np
import torch

from kiln import native
from kiln.errors import EngineFormatError
from kiln.ops.dtypes import INT8_TORCH
from kiln.tactics.base import ANY, HWC, LINEAR, MEMORY_ORDER, STORED_FLOATS, Bf16Storage, Kernel, LayerView, \
    storage_dtype
from kiln.tactics.pointwise_c import BINARY, INT8_C_TYPES, UNARY, VARIADIC, ShapedNest, expressible, generate, \
    loop_nest, nest_array, read_inputs
from kiln.tactics.reference import ReferenceTactic

available = native.available   # "codegen" is an available tactic source where kiln.native has a C compiler
CODEGEN_TACTIC = "codegen.pointwise_c_simd"
POINTWISE_LIBRARY = "pointwise"   # kiln.native's name for generated pointwise programs
MAX_INPUTS = 32
SINGLE_OPS = tuple(sorted(set(UNARY) | set(BINARY) | set(VARIADIC)))   # elementwise ops with no host inputs


def one_op_program(layer: LayerView) -> LayerView | None:
    """A PointWise layer as is; a QAdd as its program (`quantized_add_program`); a single elementwise layer (Add,
    Sigmoid, ...: an op the generator writes, or an inference BatchNormalization) as the one-step PointWise program
    PointWiseFusion would give it (kiln.passes.pointwise.as_program); else None."""
    if layer.op_type == "PointWise" and layer.domain == "kiln":
        return layer
    if layer.op_type == "QAdd" and layer.domain == "kiln":
        return quantized_add_program(layer)
    if layer.domain not in ("", "ai.onnx") or layer.op_type not in (*SINGLE_OPS, "BatchNormalization") or \
            None in layer.input_shapes:
        return None
    attrs = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in layer.attrs.items()}
    step = {"op": layer.op_type, "attrs": attrs, "args": [f"x{i}" for i in range(len(layer.input_shapes))]}
    return dataclasses.replace(layer, op_type="PointWise", domain="kiln", attrs={"program": [step]})


def quantized_add_program(layer: LayerView) -> LayerView:
    """kiln's INT8 sum (QAdd) as the program it is: both inputs dequantized, added, the activation, quantized."""
    q, spec = layer.attrs["quant"], layer.attrs.get("activation")
    lo, hi = saturation(q.get("y_dtype")) or (None, None)   # no INT8 output: not expressible, declined
    steps = [{"op": "Dequantize", "attrs": {}, "args": [f"x{i}", {"const": q[f"{side}_scale"]},
                                                         {"const": q[f"{side}_zero_point"]}]}
             for i, side in enumerate("ab")]
    steps.append({"op": "Add", "attrs": {}, "args": ["t0", "t1"]})
    if spec:
        steps.append({"op": spec["op"], "attrs": dict(spec.get("attrs", {})), "args": ["t2"]})
    steps.append({"op": "Quantize", "attrs": {"lo": lo, "hi": hi},
                  "args": [f"t{len(steps) - 1}", {"const": q["y_scale"]}, {"const": q["y_zero_point"]}]})
    return dataclasses.replace(layer, op_type="PointWise", attrs={"program": steps})


def program_view(layer: LayerView) -> LayerView | None:
    """The layer as the generator compiles it: a PointWise program (`one_op_program`) with each BatchNormalization
    step folded into a per-channel scale and shift (`fold_batchnorm`) and each Q/DQ step of one scale made kiln's
    Quantize/Dequantize (`quantize_steps`); None where it has no such form."""
    program = one_op_program(layer)
    program = None if program is None else fold_batchnorm(program)
    return None if program is None else quantize_steps(program)


Q_DQ = ("QuantizeLinear", "DequantizeLinear")
QUANTIZE_STEP_TYPES = (*INT8_C_TYPES, "int16", "uint16")   # what a Quantize step inside a program rounds to


def saturation(dtype: str | None, types=tuple(INT8_C_TYPES)) -> tuple[int, int] | None:
    """The range QuantizeLinear saturates to for one of `types` (the INT8 types: "int8", "uint8"); None for any
    other."""
    return (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)) if dtype in types else None


def quantize_steps(layer: LayerView) -> LayerView | None:
    """Each QuantizeLinear / DequantizeLinear step with one FP32 scale and INT8 zero point (constants) as kiln's
    Quantize (saturating to the zero point's type) / Dequantize step; None where a step has other parameters."""
    steps = layer.attrs.get("program", [])
    if not any(step.get("op") in Q_DQ for step in steps):
        return layer
    program = []
    for step in steps:
        if step.get("op") not in Q_DQ:
            program.append(step)
            continue
        args, attrs = step.get("args", []), step.get("attrs", {})
        scale, zp = (layer.const_inputs.get(_input_index(a)) for a in (args + [None, None])[1:3])
        if len(args) not in (2, 3) or scale is None or scale.numel() != 1 or scale.dtype != torch.float32 or \
                (len(args) == 3 and (zp is None or zp.numel() != 1)) or attrs.get("block_size") or \
                attrs.get("output_dtype"):
            return None
        # a 16-bit Q/DQ round trip between float steps rounds to its grid: such tensors are never stored (`supports`)
        bounds = saturation("uint8" if zp is None else str(zp.dtype).removeprefix("torch."), QUANTIZE_STEP_TYPES)
        if bounds is None:
            return None
        params = [args[0], args[1], args[2] if len(args) == 3 else {"const": 0.0}]
        program.append({"op": "Quantize", "attrs": {"lo": bounds[0], "hi": bounds[1]}, "args": params}
                       if step["op"] == "QuantizeLinear" else {"op": "Dequantize", "attrs": {}, "args": params})
    return dataclasses.replace(layer, attrs={"program": program})


def _input_index(arg) -> int:
    """The layer input a program argument names ("x3": 3); -1 for a step's result, a host constant or none."""
    return int(arg[1:]) if isinstance(arg, str) and arg[:1] == "x" and arg[1:].isdigit() else -1


def int8_types(layer: LayerView) -> tuple[dict[int, str], str | None] | None:
    """(runtime inputs stored as INT8 -> their type, the output's INT8 type or None) of a program view: an INT8
    input only as Dequantize steps read it, an INT8 output only from a last Quantize step of its range; None where
    the program reads or writes INT8 otherwise."""
    steps = layer.attrs.get("program", [])
    inputs = {i: d for i, d in enumerate(layer.input_dtypes) if d in INT8_C_TYPES and i not in layer.const_inputs}
    names = {f"x{i}" for i in inputs}
    for step in steps:
        first = 1 if step["op"] == "Dequantize" else 0
        if any(isinstance(a, str) and a in names for a in step.get("args", [])[first:]):
            return None
    out = layer.output_dtypes[0]
    if out not in INT8_C_TYPES:
        return inputs, None
    last = steps[-1] if steps else {}
    if last.get("op") != "Quantize" or (last["attrs"]["lo"], last["attrs"]["hi"]) != saturation(out):
        return None
    return inputs, out


def fold_batchnorm(layer: LayerView) -> LayerView | None:
    """Each inference BatchNormalization step of the program as kiln's ScaleShift step, x * scale + shift, with
    scale = gamma / sqrt(var + eps) and shift = beta - mean * scale computed once in double. Its four parameters,
    constants of one value per channel, become [C, 1, ...] tensors that broadcast along axis 1 (scale and shift in
    gamma's and beta's places, mean and var unused scalars). None where a step's parameters are not such constants,
    or another step reads them."""
    steps = layer.attrs.get("program", [])
    if not any(step.get("op") == "BatchNormalization" for step in steps):
        return layer
    uses = collections.Counter(a for step in steps for a in step.get("args", []) if isinstance(a, str))
    params: dict[int, tuple[int, ...]] = {}   # step index -> gamma, beta, mean, var input indices
    for k, step in enumerate(steps):
        if step.get("op") != "BatchNormalization":
            continue
        args = step.get("args", [])
        at = [_input_index(a) for a in args[1:]]
        if len(args) != 5 or step.get("attrs", {}).get("training_mode", 0) or len(set(at)) != 4 or \
                any(i not in layer.const_inputs or layer.const_inputs[i].dim() != 1 or uses[f"x{i}"] != 1
                    for i in at):
            return None
        params[k] = tuple(at)
    folded = {i for at in params.values() for i in at}
    rank = max((len(s) for i, s in enumerate(layer.input_shapes) if i not in folded), default=0)
    if rank < 2:
        return None
    shapes, consts, program = list(layer.input_shapes), dict(layer.const_inputs), list(steps)
    for k, (g, b, m, v) in params.items():
        gamma, beta, mean, var = (layer.const_inputs[i].double() for i in (g, b, m, v))
        scale = gamma / torch.sqrt(var + float(steps[k].get("attrs", {}).get("epsilon", 1e-5)))
        per_channel = (len(gamma),) + (1,) * (rank - 2)
        consts[g], consts[b] = scale.float().reshape(per_channel), (beta - mean * scale).float().reshape(per_channel)
        consts[m] = consts[v] = torch.zeros(())
        shapes[g] = shapes[b] = per_channel
        shapes[m] = shapes[v] = ()
        program[k] = {"op": "ScaleShift", "attrs": {}, "args": [steps[k]["args"][0], f"x{g}", f"x{b}"]}
    return dataclasses.replace(layer, input_shapes=tuple(shapes), const_inputs=consts, attrs={"program": program})


def _scalar_inputs(layer: LayerView) -> dict[int, float]:
    return {i: float(t.reshape(-1)[0]) for i, t in layer.const_inputs.items() if t.numel() == 1}


def _is_flat(layer: LayerView) -> bool:
    """Every input read element for element (no broadcast, no tensor constant): any layout works."""
    out = tuple(np.broadcast_shapes(*layer.input_shapes))
    scalars = _scalar_inputs(layer)
    return all(i in scalars or (i not in layer.const_inputs and tuple(s) == out)
               for i, s in enumerate(layer.input_shapes))


def _padded(shape: tuple[int, ...], rank: int = 4) -> tuple[int, ...]:
    return (1,) * (rank - len(shape)) + tuple(shape)


def _channel_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape broadcast to NCHW, in NHWC order (the order a channel-major tensor holds its elements in)."""
    return tuple(_padded(shape)[k] for k in MEMORY_ORDER[HWC])


def _reference_input(layer: LayerView) -> int | None:
    """The first input read per call that holds the whole output: its layout decides the kernel's and the output's."""
    out = tuple(np.broadcast_shapes(*layer.input_shapes))
    return next((i for i, s in enumerate(layer.input_shapes) if i not in layer.const_inputs and tuple(s) == out),
                None)


def _broadcasts_channel_major(layer: LayerView) -> bool:
    """A 4-D broadcasting layer the kernel can also run on channel-major tensors (a squeeze-excite scale, a
    per-channel constant, a spatial mask): a runtime input holds the whole output, the other 4-D inputs are made
    channel-major per call, constants are permuted once, and any lower-rank runtime input reads the same in either
    order (no channel axis, or channels only)."""
    if len(np.broadcast_shapes(*layer.input_shapes)) != 4 or _reference_input(layer) is None:
        return False
    for i, shape in enumerate(layer.input_shapes):
        padded = _padded(shape)
        if i not in layer.const_inputs and len(shape) < 4 and padded[1] != 1 and padded[2:] != (1, 1):
            return False
    return True


def _layout_free(layer: LayerView) -> bool:
    return _is_flat(layer) or _broadcasts_channel_major(layer)


class CodegenPointWiseTactic:
    name = CODEGEN_TACTIC
    source = "codegen"
    needs_c_compiler = True
    stored_types = ("float32",)   # the types its inputs and output may be stored in

    def supports(self, layer: LayerView) -> bool:
        layer = program_view(layer)
        if layer is None or not layer.input_shapes:
            return False
        if len(layer.input_shapes) > MAX_INPUTS or any(s is None for s in layer.input_shapes):
            return False
        if len(layer.output_dtypes) != 1:
            return False
        int8 = int8_types(layer)
        if int8 is None or any(d not in self.stored_types for i, d in enumerate(layer.input_dtypes)
                               if i not in int8[0] and i not in layer.const_inputs) or \
                (int8[1] is None and layer.output_dtypes[0] not in self.stored_types):
            return False
        try:
            np.broadcast_shapes(*layer.input_shapes)
        except ValueError:
            return False
        return expressible(layer.attrs.get("program", []), len(layer.input_shapes)) and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY if _layout_free(program_view(layer)) else LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        """The reference input's layout (`input_formats` lists the inputs read per call, constants left out)."""
        layer = program_view(layer)
        ref = _reference_input(layer)
        if ref is None or not _layout_free(layer):
            return LINEAR
        return input_formats[sum(1 for i in range(ref) if i not in layer.const_inputs)]

    def prepare(self, layer: LayerView) -> Kernel:
        if any(layer.input_dynamic):
            return ShapedPointWise(layer)   # shapes that vary per call
        layer = program_view(layer)
        out_shape = tuple(np.broadcast_shapes(*layer.input_shapes))
        scalars = _scalar_inputs(layer)
        flat = _is_flat(layer)
        consts = {i: t.to(torch.float32).contiguous() for i, t in layer.const_inputs.items() if i not in scalars}
        planar = _compiled(layer, [out_shape if flat else s for s in layer.input_shapes], scalars, consts)
        channel_major = planar   # a flat loop reads either layout
        if not flat and _broadcasts_channel_major(layer):
            permuted = {i: t.reshape(_padded(layer.input_shapes[i])).permute(*MEMORY_ORDER[HWC]).contiguous()
                        for i, t in consts.items()}
            channel_major = _compiled(layer, [_channel_major(s) for s in layer.input_shapes], scalars, permuted)
        read = [i for i in range(len(layer.input_shapes)) if i not in scalars and i not in consts]
        ref = _reference_input(layer)
        check_layout = ref is not None and _layout_free(layer) and len(out_shape) == 4
        out = layer.output_dtypes[0]
        out_dtype = INT8_TORCH.get(out) or storage_dtype(out)
        pointer_array = ctypes.c_void_p * len(layer.input_shapes)
        last = torch.channels_last

        def run(xs):
            kernel, fmt = planar, torch.contiguous_format
            if check_layout:   # the reference input's layout, the others made so (no copy where already laid out)
                first = xs[ref]
                if not first.is_contiguous() and first.is_contiguous(memory_format=last):
                    kernel, fmt = channel_major, last
            ins = [xs[i].contiguous(memory_format=fmt) if xs[i].dim() == 4 else xs[i].contiguous() for i in read]
            pointers = pointer_array(*kernel.constant_pointers)   # per call: other threads' contexts share it
            for i, x in zip(read, ins):
                pointers[i] = x.data_ptr()
            out = torch.empty(out_shape, dtype=out_dtype, memory_format=fmt)
            kernel.fn(pointers, out.data_ptr(), None)
            return [out]
        run.generated_source = planar.source
        run.constants = (planar, channel_major)   # each holds the constants its code reads through raw pointers
        return run


MAX_CALL_SHAPES = 64   # per shaped kernel: the loop nests kept for the input shapes met (the oldest dropped past it)


_UNPLANNED = object()


class ShapedPointWise:
    """A program whose input shapes vary per call: the broadcast pattern at the build's shapes compiled once (a
    planar and, where the layer takes channel-major tensors, a channel-major kernel), the loop nest of each call's
    shapes computed once per shape and passed in. A call whose pattern differs from the compiled one (an axis
    broadcast along the inner loop that was not at the build's shapes) runs torch's kernel."""

    def __init__(self, original: LayerView):
        layer = self.layer = program_view(original)
        scalars = _scalar_inputs(layer)
        consts = {i: t.to(torch.float32).contiguous() for i, t in layer.const_inputs.items() if i not in scalars}
        self.flat = _is_flat(layer)
        self.channel_major_ok = _layout_free(layer) and len(np.broadcast_shapes(*layer.input_shapes)) == 4
        self.planar = self.channel_major = _compiled(layer, list(layer.input_shapes), scalars, consts, shaped=True)
        if self.channel_major_ok and not self.flat:
            permuted = {i: t.reshape(_padded(layer.input_shapes[i])).permute(*MEMORY_ORDER[HWC]).contiguous()
                        for i, t in consts.items()}
            self.channel_major = _compiled(layer, [_channel_major(s) for s in layer.input_shapes], scalars,
                                           permuted, shaped=True)
        self.read = read_inputs(layer.attrs["program"], len(layer.input_shapes), scalars)   # through pointers
        self.runtime = [i for i in self.read if i not in consts]   # of them, those given per call
        self.given = [i for i in range(len(layer.input_shapes)) if i not in layer.const_inputs]   # all, for shapes
        self.ref = _reference_input(layer)
        out = layer.output_dtypes[0]
        self.out_dtype = INT8_TORCH.get(out) or storage_dtype(out)
        self.reference = ReferenceTactic().prepare(original)
        self.pointer_array = ctypes.c_void_p * len(layer.input_shapes)
        self.plans: dict[tuple, tuple | None] = {}
        self.generated_source = self.planar.source

    def call_plan(self, shapes: dict[int, tuple[int, ...]], channels_last: bool) -> tuple | None:
        """(kernel, nest array, output shape) for inputs of these shapes; None where the kernel cannot take them."""
        logical = [shapes.get(i, tuple(s)) for i, s in enumerate(self.layer.input_shapes)]
        try:
            out_shape = tuple(np.broadcast_shapes(*logical))
        except ValueError:
            return None   # torch's kernel says why
        kernel = self.channel_major if channels_last else self.planar
        if channels_last and self.flat and any(logical[i] != out_shape for i in self.given):
            return None   # element for element in memory order only while nothing broadcasts
        if channels_last and not self.flat:
            if len(out_shape) != 4 or any(len(logical[i]) < 4 and not _reads_alike(logical[i])
                                          for i in self.given):
                return None
            logical = [_channel_major(s) for s in logical]
        nest = loop_nest(tuple(np.broadcast_shapes(*logical)), logical)
        if nest.dims[-1] > 1 and any(bool(nest.strides[i][-1]) != kernel.dense_inner[i] for i in self.read):
            return None
        values = nest_array(nest, self.read)
        return kernel, (ctypes.c_int64 * len(values))(*values), out_shape

    def __call__(self, xs):
        ref = None if self.ref is None or not self.channel_major_ok else xs[self.ref]
        channels_last = ref is not None and ref.dim() == 4 and not ref.is_contiguous() and \
            ref.is_contiguous(memory_format=torch.channels_last)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        key = (tuple(tuple(xs[i].shape) for i in self.given), channels_last)
        plan = self.plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(self.plans) >= MAX_CALL_SHAPES:
                try:
                    self.plans.pop(next(iter(self.plans)), None)   # the oldest
                except (RuntimeError, StopIteration):   # another context's thread changed it meanwhile: no matter
                    pass
            plan = self.plans[key] = self.call_plan(dict(zip(self.given, key[0])), channels_last)
        if plan is None:
            wide = [x.float() if x is not None and x.dtype == torch.bfloat16 else x for x in xs]
            y = self.reference(wide)[0].to(self.out_dtype)
            return [y.contiguous(memory_format=fmt) if y.dim() == 4 else y.contiguous()]
        kernel, nest, out_shape = plan
        pointers = self.pointer_array(*kernel.constant_pointers)
        ins = [xs[i].contiguous(memory_format=fmt) if xs[i].dim() == 4 else xs[i].contiguous()
               for i in self.runtime]
        for i, x in zip(self.runtime, ins):   # `ins` holds the copies until the kernel returns
            pointers[i] = x.data_ptr()
        y = torch.empty(out_shape, dtype=self.out_dtype,
                        memory_format=fmt if len(out_shape) == 4 else torch.contiguous_format)
        if y.numel():
            kernel.fn(pointers, y.data_ptr(), nest)
        return [y]


def _reads_alike(shape: tuple[int, ...]) -> bool:
    """Whether an input of lower rank than 4 reads the same in NCHW and NHWC order (no channel axis, or only it)."""
    padded = _padded(shape)
    return padded[1] == 1 or padded[2:] == (1, 1)


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A PointWise program compiled for inputs of given shapes, with the constants it reads (held here, as long as
    the kernel lives) and each input's constant pointer (None for inputs read per call)."""

    fn: object
    source: str
    constants: dict[int, torch.Tensor]
    constant_pointers: tuple[int | None, ...]
    dense_inner: tuple[bool, ...] = ()   # a shaped program's inputs read densely along the inner loop


def _compiled(layer: LayerView, shapes: list[tuple[int, ...]], scalars: dict[int, float],
              consts: dict[int, torch.Tensor], shaped: bool = False) -> CompiledProgram:
    """The program compiled for inputs of these shapes, each input's elements in that shape's row-major order;
    `shaped`: for any shapes of that broadcast pattern, the loop nest given per call (pointwise_c.ShapedNest)."""
    out_shape = tuple(np.broadcast_shapes(*shapes))
    nest = loop_nest(out_shape, shapes)
    if shaped:
        nest = ShapedNest(tuple(bool(strides[-1]) for strides in nest.strides))
    consts_at = set(layer.const_inputs)   # constants are held in FP32
    try:
        bf16 = frozenset(i for i, d in enumerate(layer.input_dtypes) if d == "bfloat16" and i not in consts_at)
        int8_inputs, int8_output = int8_types(layer)
        source = generate(layer.attrs["program"], len(shapes), nest, scalars, bf16,
                          layer.output_dtypes[0] == "bfloat16", int8_inputs, int8_output)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise EngineFormatError(f"a PointWise program cannot be compiled ({exc}); the engine is damaged, "
                                "rebuild it") from None
    fn = native.library(POINTWISE_LIBRARY, source).kiln_pointwise
    pointers = tuple(consts[i].data_ptr() if i in consts else None for i in range(len(shapes)))
    return CompiledProgram(fn, source, consts, pointers, nest.dense_inner if shaped else ())


class CodegenPointWiseBf16Tactic(Bf16Storage, CodegenPointWiseTactic):
    """The same generated loop reading and writing tensors as a BF16 plan stores them: inputs widened from bf16 as
    they are loaded, the FP32 result rounded to nearest even as it is stored, so a pointwise layer between BF16
    layers keeps their tensors bf16. Its arithmetic is FP32; its only rounding is its output's."""

    name = CODEGEN_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset(range(MAX_INPUTS))
