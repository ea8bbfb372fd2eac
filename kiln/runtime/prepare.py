"""Turn a planned layer (tactic name + arguments) into a callable kernel: one function for the executor and
for build-time measurements of whole segments."""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kiln import hardware, native
from kiln.errors import EngineFormatError
from kiln.ops.nn import check_window_attrs
from kiln.plan.model import Layer
from kiln.tactics import onnxruntime_source, openvino_source
from kiln.tactics.base import HWC, LINEAR, STORED_FLOATS, Kernel, LayerView, storage_dtype
from kiln.tactics.onnx_emit import emit_region
from kiln.tactics.onnxruntime_source import REGION_TACTIC, region_kernel
from kiln.tactics.openvino_source import OPENVINO_REGION_TACTIC
from kiln.tactics.reference import ReferenceTactic, as_planned
from kiln.tactics.reformat import NOOP_TACTIC, REFORMAT_TACTIC, prepare_reformat
from kiln.tactics.storage import native_view, with_conversions


log = logging.getLogger("kiln.runtime")


class TorchWeights(dict):
    """Weights as torch tensors, converted on first use (a plan run entirely by onnxruntime converts none)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        super().__init__()
        self.arrays = arrays

    def __missing__(self, name: str) -> torch.Tensor:
        tensor = torch.from_numpy(np.array(self.arrays[name]))
        self[name] = tensor
        return tensor


def layer_view(layer: Layer, weights: dict[str, Any], opset: int, with_consts: bool = True) -> LayerView:
    """What a tactic sees of a planned layer (weights from `weights`, numpy arrays or torch tensors)."""
    shapes = {t.name: t for t in layer.inputs}

    def shape(a):
        return shapes[a.name].dims if a.kind == "tensor" else tuple(weights[a.name].shape) if a.kind == "weight" else None

    def dtype(a):
        if a.kind == "tensor":
            return shapes[a.name].dtype
        return str(np.dtype(str(weights[a.name].dtype).replace("torch.", ""))) if a.kind == "weight" else None

    consts = {i: weights[a.name] for i, a in enumerate(layer.args) if a.kind == "weight"} if with_consts else {}
    dynamic = tuple(shapes[a.name].dynamic if a.kind == "tensor" else () for a in layer.args)
    return LayerView(layer.op_type, layer.domain, layer.attrs, tuple(shape(a) for a in layer.args),
                     tuple(dtype(a) for a in layer.args), consts, tuple(t.dtype for t in layer.outputs), opset, dynamic)


def region_library(layer: Layer) -> str | None:
    """Which installed library runs a region here: the one it was built for, else onnxruntime (the same ONNX
    sub-model), else None (its inner layers then run on torch's reference kernels)."""
    if layer.tactic_name == OPENVINO_REGION_TACTIC and openvino_source.available():
        return "openvino"
    return "onnxruntime" if onnxruntime_source.available() else None


def prepare_region(layer: Layer, weights: dict[str, np.ndarray], opset: int, cached: bool = False,
                   library: str = "onnxruntime") -> Kernel:
    opset = max(13, opset)
    steps = [(layer_view(inner, weights, opset, with_consts=False),
              [None if a.kind == "none" else (a.kind, a.name) for a in inner.args],
              inner.outputs[0].name if len(inner.outputs) == 1 else [t.name for t in inner.outputs], inner.name)
             for inner in layer.inner]
    model, external = emit_region([(t.name, t.shape_spec, t.dtype) for t in layer.inputs], steps,
                                  [(t.name, t.dtype) for t in layer.outputs], weights, opset)
    names = [t.name for t in layer.inputs], [t.name for t in layer.outputs]
    if library == "openvino":
        return openvino_source.region_kernel(model, external, *names, cached=cached,
                                             precision=layer.attrs.get("precision", "f32"))
    return region_kernel(model, external, *names, bool(layer.attrs.get("spinning", False)))


def prepare_kernel(layer: Layer, weights: dict[str, torch.Tensor], np_weights: dict[str, np.ndarray],
                   opset: int, cached: bool = False) -> Kernel:
    """`cached`: external libraries may use their compiled-model caches (loaded engines; not build candidates)."""
    from kiln.tactics.registry import TACTICS_BY_NAME

    for one in (layer, *layer.inner):
        bad = check_window_attrs(one.op_type, one.attrs)
        if bad:
            raise EngineFormatError(f"layer '{one.name}' ({one.op_type}): {bad}; the engine is damaged, rebuild it")
    if layer.tactic_name in (REFORMAT_TACTIC, NOOP_TACTIC):
        return prepare_reformat(layer.attrs["target_format"])
    if layer.tactic_name == "kiln.constant":
        value = weights[layer.args[0].name]
        return lambda xs: [value]
    if layer.tactic_name in (REGION_TACTIC, OPENVINO_REGION_TACTIC):
        library = region_library(layer)
        if library is not None:
            if layer.tactic_name == OPENVINO_REGION_TACTIC and library != "openvino":
                log.warning("layer '%s' was built for OpenVINO, which is not installed here: onnxruntime runs the "
                            "same region (pip install openvino for the latency the build measured)", layer.name)
            return prepare_region(layer, np_weights, opset, cached, library)
        _warn_missing(layer.tactic_name, "onnxruntime" if layer.tactic_name == REGION_TACTIC else "OpenVINO")
        return reference_region(layer, weights, opset)
    tactic = TACTICS_BY_NAME.get(layer.tactic_name)
    if tactic is None:
        raise EngineFormatError(f"layer '{layer.name}' uses tactic '{layer.tactic_name}', unknown to this kiln; "
                                "rebuild the engine")
    while getattr(tactic, "fallback_tactic", None) is not None and not hardware.has_any(tactic.required_isa):
        _warn_fallback(tactic.name, " or ".join(tactic.required_isa), tactic.fallback_tactic.name)
        tactic = tactic.fallback_tactic   # e.g. an AMX kernel's AVX512-BF16 sibling: same layer, same precision
    # kiln's C kernels (generated pointwise programs included) say `needs_c_compiler`: an engine built elsewhere,
    # loaded where kiln.native has no compiler, runs those layers on the reference kernels (Winograd keeps its
    # own torch path)
    if getattr(tactic, "needs_c_compiler", False) and not native.available():
        _warn_missing(layer.tactic_name, "a C compiler (cc)")
        tactic = ReferenceTactic()   # an engine built elsewhere: the same layer on torch's kernels
    elif not hardware.has_any(getattr(tactic, "required_isa", ())):
        _warn_missing(layer.tactic_name, " or ".join(tactic.required_isa) + " (this CPU lacks it)")
        tactic = ReferenceTactic()   # built on a CPU with the extension: the same layer in FP32 on torch's kernels
    elif tactic.source == "onnxruntime" and not onnxruntime_source.available():
        _warn_missing(layer.tactic_name, "onnxruntime")
        tactic = ReferenceTactic()
    elif getattr(tactic, "needs_library", "") and not native.buildable(tactic.needs_library):
        _warn_library(tactic.name, tactic.needs_library, tactic.library_fallback.name)
        tactic = tactic.library_fallback   # e.g. oneDNN's primitive -> the same layer through torch's oneDNN ops
    view, widen, narrow = native_view(layer_view(layer, weights, opset), tactic)   # bf16 tensors it cannot read
    kernel = tactic.prepare(view)
    if isinstance(tactic, ReferenceTactic):
        kernel = in_planned_formats(kernel, layer)
    elif getattr(tactic, "outputs_as_planned", False):
        kernel = as_planned(kernel, planned_formats(layer))
    return with_conversions(kernel, widen, narrow)


@lru_cache(maxsize=None)
def _warn_missing(tactic_name: str, what: str) -> None:
    log.warning("%s is not available here for %s (an engine built on another machine): its layers run on torch's "
                "reference kernels, slower; install it or rebuild the engine here", what, tactic_name)


@lru_cache(maxsize=None)
def _warn_fallback(tactic_name: str, isa: str, fallback_name: str) -> None:
    log.warning("%s needs %s, which this CPU lacks (an engine built on another machine): its layers run on %s, "
                "in the same precision", tactic_name, isa, fallback_name)


@lru_cache(maxsize=None)
def _warn_library(tactic_name: str, library: str, fallback_name: str) -> None:
    log.warning("%s links %s, which is not installed here (an engine built on another machine): its layers run on "
                "%s, in the same precision; `pip install kiln[%s]` restores it", tactic_name, library, fallback_name,
                library)


def reference_region(layer: Layer, weights: dict[str, torch.Tensor], opset: int) -> Kernel:
    """A region's inner layers one after another on torch's reference kernels, for a machine that lacks the
    library the region was built for. Inputs and outputs stay row-major, as the plan expects of a region."""
    from kiln.runtime.interpreter import Interpreter

    kernels = [in_planned_formats(ReferenceTactic().prepare(layer_view(one, weights, opset)), one)
               for one in layer.inner]
    interpreter = Interpreter(layer.inner, kernels)
    input_names, output_names = [t.name for t in layer.inputs], [t.name for t in layer.outputs]

    def run(xs):
        env = interpreter.run(dict(zip(input_names, [x for x in xs if x is not None])))
        return [env[n].contiguous() for n in output_names]
    return run


def in_planned_formats(kernel: Kernel, layer: Layer) -> Kernel:
    """The reference kernels follow torch's layout rules, which do not always give the format the plan records
    for a layout-agnostic op: torch.cat of a row-major and a channel-major input is row-major, recorded as
    channel-major. Outputs recorded channel-major are made so (no copy when they already are), so layer info
    tells the truth and consumers do not each pay a hidden conversion."""
    formats = planned_formats(layer)
    if HWC not in formats:
        return kernel
    if layer.op_type == "Concat" and layer.domain in ("", "ai.onnx"):
        axis, last = layer.attrs.get("axis", 1) % 4, torch.channels_last

        out_dtype = layer.outputs[0].dtype
        stored = storage_dtype(out_dtype) if out_dtype in STORED_FLOATS else None

        def concat(xs):
            """Straight into a channel-major output: 4x faster than concatenating row-major, then converting; in the
            type the plan stores the output in, inputs stored otherwise converted first (torch.cat converting as it
            copies is 10x slower)."""
            dtype = stored or xs[0].dtype
            shape = list(xs[0].shape)
            shape[axis] = sum(x.shape[axis] for x in xs)
            out = torch.empty(shape, dtype=dtype, memory_format=last)
            return [torch.cat([x if x.dtype == dtype else x.to(dtype) for x in xs], axis, out=out)]
        return concat

    return as_planned(kernel, formats)


def planned_formats(layer: Layer) -> list[str]:
    """The layout the plan records for each output, as a layout-following kernel must give it (4-D tensors only)."""
    return [HWC if o.format == HWC and len(o.dims) == 4 else LINEAR for o in layer.outputs]
