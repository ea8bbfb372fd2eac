"""kiln as an ONNX backend (`onnx.backend.base.Backend`): prepare a ModelProto, run it on numpy inputs.

    rep = kiln.backend.prepare(model)          # builds now when it can: static shapes, no build-time inputs
    outputs = rep.run([x, y])                  # graph-output order, numpy arrays of the ONNX dtypes

kiln needs some inputs at build time (a Reshape's shape, Slice's starts, Clip's bounds: an op's `host_inputs`).
Where a graph input feeds one, the backend freezes the value given to `run` into the engine as an initializer;
engines are built on first use and cached per input shapes and frozen values (dynamic dims likewise).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

import kiln
from kiln.ops import lookup

BUILD_DEFAULTS: dict[str, Any] = {"autotune": False}
EngineKey = tuple[Any, ...]


def runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs the caller feeds (initializers listed as inputs have defaults and are not fed)."""
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def build_time_inputs(model: onnx.ModelProto) -> set[str]:
    """Graph inputs some node reads at one of its op's build-time (host) input positions."""
    names = {v.name for v in runtime_inputs(model)}
    found = set()
    for node in model.graph.node:
        opdef = lookup(node.op_type, node.domain)
        host = opdef.host_inputs if opdef is not None else ()
        found |= {x for i, x in enumerate(node.input) if i in host and x in names}
    return found


def static_shape(info: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    ttype = info.type.tensor_type
    if not ttype.HasField("shape") or any(not d.HasField("dim_value") for d in ttype.shape.dim):
        return None
    return tuple(d.dim_value for d in ttype.shape.dim)


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` whose inputs named in `values` become initializers (their inputs entries removed)."""
    if not values:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [v for v in out.graph.input if v.name not in values]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in values.items())
    return out


def engine_key(shapes: dict[str, tuple[int, ...]], frozen: dict[str, np.ndarray]) -> EngineKey:
    values = tuple((n, a.dtype.str, a.shape, a.tobytes()) for n, a in sorted(frozen.items()))
    return tuple(sorted(shapes.items())), values


class KilnRep(BackendRep):
    """A prepared model: one kiln engine per distinct input shapes and frozen build-time input values."""

    def __init__(self, model: onnx.ModelProto, options: dict[str, Any]):
        inputs = runtime_inputs(model)
        for v in inputs:
            kind = v.type.WhichOneof("value")
            if kind != "tensor_type":
                raise kiln.ModelError(f"input '{v.name}' has type {kind}; kiln's inputs are tensors")
        self.model, self.options = model, options
        self.input_names = [v.name for v in inputs]
        self.output_names = [v.name for v in model.graph.output]
        self.frozen_names = build_time_inputs(model)
        self.engines: dict[EngineKey, kiln.Engine] = {}
        static = {v.name: static_shape(v) for v in inputs}
        if not self.frozen_names and all(s is not None for s in static.values()):
            self.engine(static, {})   # build errors surface at prepare, as backends report them

    def engine(self, shapes: dict[str, tuple[int, ...]], frozen: dict[str, np.ndarray]) -> kiln.Engine:
        key = engine_key(shapes, frozen)
        if key not in self.engines:
            model = with_initializers(self.model, frozen)
            self.engines[key] = kiln.build(model, **{**self.options, "input_shapes": shapes})
        return self.engines[key]

    def feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, dict):
            return {name: np.asarray(x) for name, x in inputs.items()}
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        if len(inputs) != len(self.input_names):
            raise kiln.InputError(f"got {len(inputs)} input(s); the model's inputs are {self.input_names}")
        return {name: np.asarray(x) for name, x in zip(self.input_names, inputs)}

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        feeds = self.feeds(inputs)
        frozen = {n: x for n, x in feeds.items() if n in self.frozen_names}
        feeds = {n: x for n, x in feeds.items() if n not in self.frozen_names}
        out = self.engine({n: tuple(x.shape) for n, x in feeds.items()}, frozen).run(feeds)
        return namedtupledict("Outputs", self.output_names)(*(out[n] for n in self.output_names))


class KilnBackend(Backend):
    """ONNX backend API over `kiln.build`; CPU only. Keyword options to `prepare` are kiln BuildOptions."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> KilnRep:
        if not cls.supports_device(device):
            raise kiln.Error(f"kiln runs on CPU only, not on device '{device}'")
        options = {**BUILD_DEFAULTS, **{k: v for k, v in kwargs.items() if k not in ("rtol", "atol")}}
        return KilnRep(model, options)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type == DeviceType.CPU
        except AttributeError:   # an unknown device type name
            return False


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
run_node = KilnBackend.run_node
supports_device = KilnBackend.supports_device

__all__ = ["KilnBackend", "KilnRep", "prepare", "run_model", "run_node", "supports_device"]
