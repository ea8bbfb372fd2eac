"""Concatenation elision: a Concat input whose only reader is the Concat is written by the layer producing it
straight into its slice of the Concat's output, and the Concat copies only the rest (TensorRT's "Eliminating
concatenation"). YOLO-style detectors concatenate a few MB per inference; each elided input saves a write and a
read of its bytes.

Decided once per run order, like in-place donation, by the plan interpreter, which runs inference and the
builder's whole-plan timing alike. A producer takes part where its kernel has `write_into(xs, out)`: compute into
`out`, a view of the Concat's output (any strides; a kernel writes its own layout directly and anything else
through a copy). The Concat's output buffer is allocated, in the layout the plan records, when its first elided
producer runs; the batch of a dynamic-batch engine is read from that producer's first input."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.ops.dtypes import NUMPY_TO_TORCH
from kiln.plan.model import Layer, TensorDesc
from kiln.tactics.base import HWC, Kernel


@dataclass(frozen=True)
class ConcatBuffer:
    """A Concat's output as its elided producers and the Concat itself find it: allocated by whichever runs first."""

    name: str
    desc: TensorDesc
    axis: int

    def get(self, env: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
        out = env.get(self.name)
        if out is None:
            shape = (batch, *self.desc.dims[1:])
            channel_major = self.desc.format == HWC and len(shape) == 4
            out = torch.empty(shape, dtype=NUMPY_TO_TORCH[np.dtype(self.desc.dtype)],
                              memory_format=torch.channels_last if channel_major else torch.contiguous_format)
            env[self.name] = out
        return out


@dataclass(frozen=True)
class IntoConcat:
    """A producer step's output goes to [offset, offset + size) of `buffer` along its axis."""

    buffer: ConcatBuffer
    offset: int
    size: int
    batch_input: int | None   # the argument whose axis 0 is the batch (dynamic batch); None: the plan's batch


@dataclass(frozen=True)
class ConcatRest:
    """A Concat step whose other inputs were written in place: it copies `copies` (input index, offset, size)."""

    buffer: ConcatBuffer
    copies: tuple[tuple[int, int, int], ...]
    elided: tuple[str, ...]   # the producers' layer names, for the build log


def plan_elisions(layers: Sequence[Layer], kernels: Sequence[Kernel],
                  keep: set[str]) -> tuple[dict[int, IntoConcat], dict[int, ConcatRest]]:
    """Per producer step, where it writes; per Concat step, what it still copies. `keep`: tensors that must stay
    whole (engine inputs and outputs, tensors a caller reads)."""
    producer = {t.name: i for i, layer in enumerate(layers) for t in layer.outputs}
    reads = Counter(a.name for layer in layers for a in layer.args if a.kind == "tensor")
    into: dict[int, IntoConcat] = {}
    rest: dict[int, ConcatRest] = {}
    for j, layer in enumerate(layers):
        buffer = _concat_buffer(layer)
        if buffer is None:
            continue
        offset, copies, elided = 0, [], []
        for i, (arg, desc) in enumerate(zip(layer.args, layer.inputs)):
            size = desc.dims[buffer.axis]
            p = producer.get(arg.name)
            target = None if p is None else _target(layers[p], kernels[p], desc, buffer, offset, size)
            if target is None or arg.name in keep or reads[arg.name] != 1 or p in into:
                copies.append((i, offset, size))
            else:
                into[p] = target
                elided.append(layers[p].name)
            offset += size
        if elided:
            rest[j] = ConcatRest(buffer, tuple(copies), tuple(elided))
    return into, rest


def _concat_buffer(layer: Layer) -> ConcatBuffer | None:
    """An ONNX Concat of activations along an axis past the batch, shapes static but for the batch, every input
    stored as its output is."""
    if layer.op_type != "Concat" or layer.domain not in ("", "ai.onnx") or len(layer.outputs) != 1:
        return None
    out = layer.outputs[0]
    rank = len(out.dims)
    if rank < 2 or np.dtype(out.dtype) not in NUMPY_TO_TORCH or any(a.kind != "tensor" for a in layer.args):
        return None
    axis = layer.attrs.get("axis", 0)
    if not -rank <= axis < rank or axis % rank == 0 or len(layer.inputs) != len(layer.args):
        return None
    axis %= rank
    for desc in (out, *layer.inputs):
        if set(desc.dynamic) - {0} or len(desc.dims) != rank or desc.dtype != out.dtype:
            return None
        if any(d != o for k, (d, o) in enumerate(zip(desc.dims, out.dims)) if k not in (0, axis)):
            return None
    return ConcatBuffer(out.name, out, axis)


def _target(producer: Layer, kernel: Kernel, desc: TensorDesc, buffer: ConcatBuffer, offset: int,
            size: int) -> IntoConcat | None:
    """Where `producer` would write `desc`: only a one-output layer whose kernel can write into a view, and whose
    batch (dynamic-batch engines) its first input says."""
    if getattr(kernel, "write_into", None) is None or len(producer.outputs) != 1:
        return None
    if producer.outputs[0].name != desc.name or getattr(kernel, "into_input", None) is not None:
        return None
    if 0 not in buffer.desc.dynamic:
        return IntoConcat(buffer, offset, size, None)
    first = next((k for k, a in enumerate(producer.args) if a.kind == "tensor"), None)
    source = producer.inputs[0] if first is not None and producer.inputs else None   # inputs: the tensor args
    if source is None or 0 not in source.dynamic or 0 not in desc.dynamic or source.dims[0] != desc.dims[0]:
        return None
    return IntoConcat(buffer, offset, size, first)


def batch_of(target: IntoConcat, xs: list) -> int:
    return target.buffer.desc.dims[0] if target.batch_input is None else xs[target.batch_input].shape[0]


def write_kernel(target: IntoConcat, kernel: Kernel, env: dict[str, torch.Tensor]) -> Kernel:
    """The producer's kernel as the step runs it: into its slice of the Concat's output, returned as its result."""
    def run(xs):
        out = target.buffer.get(env, batch_of(target, xs)).narrow(target.buffer.axis, target.offset, target.size)
        kernel.write_into(xs, out)
        return [out]
    return run


def rest_kernel(rest: ConcatRest, env: dict[str, torch.Tensor]) -> Kernel:
    """The Concat's kernel as the step runs it: the inputs nobody wrote in place, copied into their slices."""
    def run(xs):
        batch = next(x for x in xs if x is not None).shape[0]
        out = rest.buffer.get(env, batch)
        for i, offset, size in rest.copies:
            out.narrow(rest.buffer.axis, offset, size).copy_(xs[i])
        return [out]
    return run
