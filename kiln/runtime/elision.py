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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.ops.dtypes import NUMPY_TO_TORCH
from kiln.plan.model import Layer, TensorDesc
from kiln.tactics.base import HWC, Kernel
from kiln.trt import build_log as log_lines


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


@dataclass(frozen=True)
class ConcatInput:
    """One input of a Concat as the plan runs it: written in place by its producer (`target`), or copied, and why."""

    tensor: str
    producer: int | None   # the step writing it; None: an engine input
    target: IntoConcat | None
    copy_reason: str | None


@dataclass(frozen=True)
class ConcatDecision:
    """What becomes of Concat layer `step`: its output `buffer` and each input's fate, or (`buffer` None) why
    nothing of it can be elided."""

    step: int
    buffer: ConcatBuffer | None
    blocked: str | None = None
    inputs: tuple[ConcatInput, ...] = ()


def plan_elisions(layers: Sequence[Layer], kernels: Sequence[Kernel],
                  keep: set[str]) -> tuple[dict[int, IntoConcat], dict[int, ConcatRest]]:
    """Per producer step, where it writes; per Concat step, what it still copies. `keep`: tensors that must stay
    whole (engine inputs and outputs, tensors a caller reads)."""
    into: dict[int, IntoConcat] = {}
    rest: dict[int, ConcatRest] = {}
    for decision in concat_decisions(layers, kernels.__getitem__, keep):
        if decision.buffer is None:
            continue
        copies, elided, offset = [], [], 0
        for i, (one, desc) in enumerate(zip(decision.inputs, layers[decision.step].inputs)):
            size = desc.dims[decision.buffer.axis]
            if one.target is None:
                copies.append((i, offset, size))
            else:
                into[one.producer] = one.target
                elided.append(layers[one.producer].name)
            offset += size
        if elided:
            rest[decision.step] = ConcatRest(decision.buffer, tuple(copies), tuple(elided))
    return into, rest


def concat_decisions(layers: Sequence[Layer], kernel_of: Callable[[int], Kernel | None],
                     keep: set[str]) -> list[ConcatDecision]:
    """Every ONNX Concat's fate: which inputs their producers write in place, and why the others are copied.
    `kernel_of(i)`: layer i's prepared kernel (None where it has none that could write into a view)."""
    producer = {t.name: i for i, layer in enumerate(layers) for t in layer.outputs}
    reads = Counter(a.name for layer in layers for a in layer.args if a.kind == "tensor")
    decisions = []
    for j, layer in enumerate(layers):
        if layer.op_type != "Concat" or layer.domain not in ("", "ai.onnx"):
            continue
        buffer = _concat_buffer(layer)
        if isinstance(buffer, str):
            decisions.append(ConcatDecision(j, None, buffer))
            continue
        offset, inputs = 0, []
        for arg, desc in zip(layer.args, layer.inputs):
            size = desc.dims[buffer.axis]
            p = producer.get(arg.name)
            verdict = _copy_reason(arg.name, p, reads[arg.name], keep)
            if verdict is None:
                verdict = _target(layers[p], kernel_of(p), desc, buffer, offset, size)
            written = isinstance(verdict, IntoConcat)
            inputs.append(ConcatInput(arg.name, p, verdict if written else None, None if written else verdict))
            offset += size
        decisions.append(ConcatDecision(j, buffer, None, tuple(inputs)))
    return decisions


def _copy_reason(name: str, producer: int | None, reads: int, keep: set[str]) -> str | None:
    """Why an input must be copied whatever its producer's kernel can do; None if nothing forbids writing it in
    place (a one-output producer read once feeds no other Concat)."""
    if producer is None:
        return "it is an engine input"
    if name in keep:
        return "it is an engine output"
    if reads != 1:
        return "another layer reads it too" if reads == 2 else f"{reads - 1} other layers read it too"
    return None


def _concat_buffer(layer: Layer) -> ConcatBuffer | str:
    """The output of an ONNX Concat of activations along an axis past the batch, shapes static but for the batch,
    every input stored as its output is; else why not."""
    if len(layer.outputs) != 1 or any(a.kind != "tensor" for a in layer.args) or len(layer.inputs) != len(layer.args):
        return "it takes constants or makes several outputs"
    out = layer.outputs[0]
    rank = len(out.dims)
    if rank < 2:
        return "it joins vectors"
    if np.dtype(out.dtype) not in NUMPY_TO_TORCH:
        return f"kiln does not allocate {out.dtype} tensors in place"
    axis = layer.attrs.get("axis", 0)
    if not -rank <= axis < rank or axis % rank == 0:
        return "it concatenates along the batch axis"
    axis %= rank
    for desc in (out, *layer.inputs):
        if set(desc.dynamic) - {0} or len(desc.dims) != rank:
            return f"the shape of {desc.name} varies past the batch axis"
        if desc.dtype != out.dtype:
            return f"{desc.name} is stored as {desc.dtype}, its output as {out.dtype}"
        if any(d != o for k, (d, o) in enumerate(zip(desc.dims, out.dims)) if k not in (0, axis)):
            return f"the shape of {desc.name} differs from the output's past the concatenated axis"
    return ConcatBuffer(out.name, out, axis)


def _target(producer: Layer, kernel: Kernel | None, desc: TensorDesc, buffer: ConcatBuffer, offset: int,
            size: int) -> IntoConcat | str:
    """Where `producer` would write `desc`: only a one-output layer whose kernel can write into a view, and whose
    batch (dynamic-batch engines) its first input says; else why not."""
    if len(producer.outputs) != 1:
        return f"its producer {producer.name} makes {len(producer.outputs)} outputs"
    if getattr(kernel, "write_into", None) is None:
        return f"its producer {producer.name} ({producer.tactic_name}) cannot write into a strided slice"
    if getattr(kernel, "into_input", None) is not None:
        return f"its producer {producer.name} writes over its residual's buffer instead"
    if 0 not in buffer.desc.dynamic:
        return IntoConcat(buffer, offset, size, None)
    first = next((k for k, a in enumerate(producer.args) if a.kind == "tensor"), None)
    source = producer.inputs[0] if first is not None and producer.inputs else None   # inputs: the tensor args
    if source is None or 0 not in source.dynamic or 0 not in desc.dynamic or source.dims[0] != desc.dims[0]:
        return f"the batch of its producer {producer.name} is not read from its first input"
    return IntoConcat(buffer, offset, size, first)


def elision_log_lines(layers: Sequence[Layer], decisions: Sequence[ConcatDecision]) -> list[str]:
    """The build log's account of the decisions: TensorRT's "Eliminating concatenation" and "Generating copy ...
    because ..." lines, a "Retargeting" line per input written in place, and why a Concat stays whole."""
    lines = []
    for decision in decisions:
        layer = layers[decision.step]
        if decision.blocked:
            lines.append(log_lines.not_eliminating_concatenation(layer.name, decision.blocked))
            continue
        if any(one.target for one in decision.inputs):
            lines.append(log_lines.eliminating_concatenation(layer.name))
        else:
            lines.append(log_lines.not_eliminating_concatenation(layer.name, "no input can be written in place"))
        output = layer.outputs[0].name
        lines += [log_lines.retargeting(one.tensor, output) if one.target else
                  log_lines.generating_copy(one.tensor, output, one.copy_reason) for one in decision.inputs]
    return lines


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
