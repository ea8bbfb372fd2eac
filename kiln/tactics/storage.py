"""Storage precision: which tensors between layers a plan stores in BF16, and the conversions kernels need.

After lowering, a float32 tensor is stored in bf16 where the layer writing it was granted BF16 on a kernel that can
write bf16 (`writes_bf16`) and every layer reading it runs a kernel that reads bf16 at that input (`bf16_inputs`):
the conversion TensorRT would insert as a Reformat layer is fused into both neighbours, and the tensor moves half
the bytes. Engine inputs and outputs stay FP32, and so does a tensor with any FP32 reader: its BF16 readers round
it as they load it (one conversion fused into each), which costs less than a Reformat layer's extra pass. A layout
Reformat is transparent: it copies bf16 where its input is bf16 and all its output's readers read bf16.

A kernel that cannot read or write bf16 itself, but runs a layer whose plan stores bf16 tensors (torch's reference
kernel on a CPU without BF16, the accuracy budget's FP32 stand-ins), gets the conversions around it:
`native_view` says what it is prepared for, `with_conversions` wraps it.

While kernels are being chosen the rule cannot be applied yet (later layers have none), so the autotuner works from
a `StorageGuess`: the inputs a layer's producers would hand over in bf16 and whether its readers would take its
output in bf16. A kernel that reads or writes bf16 there is timed doing so; any other is charged the conversions
its choice would cost (TensorRT's Reformat layers between precisions)."""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from kiln.plan.model import Layer, TensorDesc
from kiln.tactics.base import Kernel, LayerView
from kiln.tactics.reformat import NOOP_TACTIC, REFORMAT_TACTIC
from kiln.tactics.registry import TACTICS_BY_NAME

BF16 = "bfloat16"
log = logging.getLogger("kiln.build")


REFORMATS = (REFORMAT_TACTIC, NOOP_TACTIC)   # layout copies: any dtype in, the same out


def _reads_bf16(layer: Layer, index: int, readers: dict, engine_outputs: set[str]) -> bool:
    """Whether `layer` takes input `index` in bf16: its kernel reads bf16 there, or it is a layout Reformat whose
    output every reader takes in bf16 (the Reformat then copies bf16: YOLOv8's detect head into NCHW)."""
    if layer.tactic_name in REFORMATS:
        out = layer.outputs[0].name
        return out not in engine_outputs and bool(readers[out]) and \
            all(_reads_bf16(reader, i, readers, engine_outputs) for reader, i in readers[out])
    return index in getattr(TACTICS_BY_NAME.get(layer.tactic_name), "bf16_inputs", ())


def writes_bf16(layer: Layer) -> bool:
    """Whether `layer` writes its output in bf16 where its readers all read bf16."""
    return layer.precision == "BF16" and getattr(TACTICS_BY_NAME.get(layer.tactic_name), "writes_bf16", False)


def bf16_tensors(layers: list[Layer], engine_outputs: set[str]) -> set[str]:
    """The tensors `store_bf16` keeps in bf16 (see the module's rule)."""
    readers: dict[str, list[tuple[Layer, int]]] = defaultdict(list)
    for layer in layers:
        for index, arg in enumerate(layer.args):
            if arg.kind == "tensor":
                readers[arg.name].append((layer, index))
    chosen = set()
    for layer in layers:   # in order: a Reformat's input is decided before it
        if layer.tactic_name in REFORMATS:
            if layer.args[0].name in chosen and _reads_bf16(layer, 0, readers, engine_outputs):
                chosen.add(layer.outputs[0].name)
            continue
        for out in _bf16_capable_outputs(layer):
            if out.dtype == "float32" and out.name not in engine_outputs and readers[out.name] and \
                    all(_reads_bf16(reader, index, readers, engine_outputs) for reader, index in readers[out.name]):
                chosen.add(out.name)
    return chosen


def _bf16_capable_outputs(layer: Layer) -> tuple[TensorDesc, ...]:
    """The outputs `layer` can write in bf16: a single-output kernel's one output, or each of a Split's where its
    tactic writes every output as the plan stores it (`writes_every_output`)."""
    if not writes_bf16(layer):
        return ()
    if len(layer.outputs) == 1 or getattr(TACTICS_BY_NAME.get(layer.tactic_name), "writes_every_output", False):
        return layer.outputs
    return ()


def store_bf16(layers: list[Layer], engine_outputs: set[str]) -> list[Layer]:
    """`layers` with the tensors between BF16 kernels that read and write bf16 stored in bf16."""
    chosen = bf16_tensors(layers, engine_outputs)
    if not chosen:
        return layers
    log.debug("Storage: %d tensors between BF16 kernels stored in BF16", len(chosen))

    def stored(descs: tuple[TensorDesc, ...]) -> tuple[TensorDesc, ...]:
        return tuple(dataclasses.replace(d, dtype=BF16) if d.name in chosen else d for d in descs)
    return [dataclasses.replace(layer, inputs=stored(layer.inputs), outputs=stored(layer.outputs)) for layer in layers]


def log_storage(layers: list[Layer], float32_names: set[str]) -> None:
    """One line for the plan built: how many of the model's FP32 tensors (`float32_names`) it stores in bf16.
    store_bf16 runs for every trial lowering too (the accuracy budget's, the plan race's), so it logs at debug."""
    stored = {t.name for layer in layers for t in layer.outputs if t.dtype == BF16 and t.name in float32_names}
    if stored:
        log.info("Storage: %d tensors between BF16 kernels stored in BF16 (conversions fused into their kernels)",
                 len(stored))


@dataclass(frozen=True)
class StorageGuess:
    """Around one BF16 layer, before its neighbours' kernels are all chosen: the activation inputs its producers
    write in bf16, and the output's shape where every reader would read it in bf16 (None: FP32 either way)."""

    inputs: frozenset[int] = frozenset()
    output_shape: tuple[int, ...] | None = None

    def timing_view(self, view: LayerView, tactic) -> tuple[LayerView, tuple[int, ...], bool]:
        """(`view` with the inputs and output `tactic` would read and write in bf16 given as bf16, the guessed bf16
        inputs it would need converted to FP32, whether its output would need rounding to bf16 for its readers)."""
        bf16_kernel = "BF16" in getattr(tactic, "reduced_precisions", ())
        reads = self.inputs & getattr(tactic, "bf16_inputs", frozenset()) if bf16_kernel else frozenset()
        writes = bf16_kernel and getattr(tactic, "writes_bf16", False) and self.output_shape is not None
        inputs = tuple(BF16 if i in reads else d for i, d in enumerate(view.input_dtypes))
        outputs = (BF16,) + tuple(view.output_dtypes[1:]) if writes else view.output_dtypes
        if reads or writes:
            view = dataclasses.replace(view, input_dtypes=inputs, output_dtypes=outputs)
        return view, tuple(sorted(self.inputs - reads)), self.output_shape is not None and not writes


NO_GUESS = StorageGuess()


def native_view(view: LayerView, tactic) -> tuple[LayerView, tuple[int, ...], tuple[int, ...]]:
    """(the view `tactic` is prepared with, the inputs to widen to FP32 before it, the outputs to round to bf16 after
    it): bf16 tensors a kernel does not read or write itself are FP32 to it."""
    reads, writes = getattr(tactic, "bf16_inputs", frozenset()), getattr(tactic, "writes_bf16", False)
    widen = tuple(i for i, d in enumerate(view.input_dtypes) if d == BF16 and i not in reads)
    narrow = () if writes else tuple(j for j, d in enumerate(view.output_dtypes) if d == BF16)
    if not widen and not narrow:
        return view, (), ()
    inputs = tuple("float32" if i in widen else d for i, d in enumerate(view.input_dtypes))
    outputs = tuple("float32" if j in narrow else d for j, d in enumerate(view.output_dtypes))
    return dataclasses.replace(view, input_dtypes=inputs, output_dtypes=outputs), widen, narrow


def with_conversions(kernel: Kernel, widen: tuple[int, ...], narrow: tuple[int, ...]) -> Kernel:
    """`kernel` with inputs `widen` converted to FP32 before it and outputs `narrow` rounded to bf16 after it (no
    in-place variant: the converted input is a new buffer)."""
    if not widen and not narrow:
        return kernel

    def run(xs):
        ys = kernel([x.float() if i in widen and x is not None else x for i, x in enumerate(xs)])
        return [y.to(torch.bfloat16) if j in narrow else y for j, y in enumerate(ys)]
    if hasattr(kernel, "constants"):
        run.constants = kernel.constants
    return run
