"""The one interpreter of a plan: runs planned layers on their prepared kernels in plan order, wiring arguments,
handing a dying input's buffer to an in-place kernel, and releasing each tensor after its last reader; a run of
layers on kiln's oneDNN primitives (and the C kernels that join them) goes to C as one call (kiln.runtime.chains).

Execution contexts, the builder's whole-plan and segment timing, `kiln compare --layerwise` and regions run on
reference kernels all run plans through it, so the plan that is timed is the plan that runs (torch.fx's
`Interpreter`, for kiln plans)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns

import torch

from kiln.errors import Error
from kiln.plan.liveness import free_lists
from kiln.plan.model import Layer
from kiln.runtime.chains import Chain, find_chains
from kiln.runtime.donation import donation, sole_owner
from kiln.runtime.elision import ConcatRest, IntoConcat, plan_elisions, rest_kernel, write_kernel
from kiln.tactics.base import Kernel

Observer = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Step:
    """One layer as the interpreter runs it."""

    layer: Layer
    kernel: Kernel
    args: tuple[tuple[str, str], ...]        # (kind, name) per kernel argument: "tensor" | "weight" | "none"
    outputs: tuple[str, ...]
    free: tuple[str, ...]                    # tensors whose last reader this layer is
    in_place: tuple[int, Kernel] | None      # (input index, kernel writing over that dying input)
    into_concat: IntoConcat | None = None    # writes its output into a Concat's output (kiln.runtime.elision)
    concat_rest: ConcatRest | None = None    # a Concat some of whose inputs were written in place


class Interpreter:
    """Runs `layers` on `kernels`. With `keep` (the tensors that must survive: engine inputs and outputs), every
    other tensor is released after its last reader and in-place kernels may take a dying input's buffer; with
    `keep=None` every tensor stays in the environment (segment timing reads boundary tensors). Concatenations are
    elided (kiln.runtime.elision) only with `keep`."""

    def __init__(self, layers: Sequence[Layer], kernels: Sequence[Kernel], keep: Iterable[str] | None = None):
        keep = None if keep is None else set(keep)
        frees = free_lists(layers, keep) if keep is not None else [[] for _ in layers]
        self.steps = tuple(
            Step(layer, kernel, tuple((a.kind, a.name) for a in layer.args), tuple(t.name for t in layer.outputs),
                 tuple(free), donation(layer, free, keep, kernel) if keep is not None else None)
            for layer, kernel, free in zip(layers, kernels, frees))
        into, rest = plan_elisions(layers, kernels, keep) if keep is not None else ({}, {})
        self.steps = tuple(Step(s.layer, s.kernel, s.args, s.outputs, s.free,
                                None if i in into else s.in_place, into.get(i), rest.get(i))
                           for i, s in enumerate(self.steps))
        # what an inference runs: the steps, each run of chainable layers (kiln.runtime.chains) as one Chain (only
        # with `keep`: a chain's inner tensors never reach the environment)
        chains = {c.start: c for c in find_chains(self.steps, keep)} if keep is not None else {}
        program, i = [], 0
        while i < len(self.steps):
            chain = chains.get(i)
            program.append(chain or self.steps[i])
            i = chain.stop if chain else i + 1
        self.program: tuple[Step | Chain, ...] = tuple(program)

    def run(self, env: dict[str, torch.Tensor], observe: Observer | None = None,
            profiler=None) -> dict[str, torch.Tensor]:
        """Run every step on `env` (tensor name -> tensor, updated in place and returned). `observe(name, tensor)`
        sees each tensor as it is produced; `profiler.record(layer name, ms)` gets each layer's time (both run
        every layer on its own kernel: no chains)."""
        if observe is None and profiler is None:
            for item in self.program:
                if type(item) is Chain:
                    item.run(env)
                else:
                    _run_step(item, env, None, None)
            return env
        for step in self.steps:
            _run_step(step, env, observe, profiler)
        return env


def _run_step(step: Step, env: dict[str, torch.Tensor], observe: Observer | None, profiler) -> None:
    xs = [env[n] if kind == "tensor" else None for kind, n in step.args]
    kernel = step.kernel
    if step.in_place is not None and sole_owner(xs[step.in_place[0]], env):
        kernel = step.in_place[1]
    elif step.into_concat is not None:
        kernel = write_kernel(step.into_concat, kernel, env)
    elif step.concat_rest is not None:
        kernel = rest_kernel(step.concat_rest, env)
    try:
        results = kernel(xs) if profiler is None else _profiled(step.layer, kernel, xs, profiler)
    except Error:
        raise
    except Exception as exc:   # a damaged engine or a library failure: name the layer
        raise Error(f"layer '{step.layer.name}' ({step.layer.op_type}) failed: "
                    f"{type(exc).__name__}: {exc}") from None
    for name, value in zip(step.outputs, results):
        env[name] = value
        if observe is not None:   # a tensor stored in bf16 is seen as the FP32 values it holds
            observe(name, value.float() if value.dtype == torch.bfloat16 else value)
    for name in step.free:
        env.pop(name, None)


def _profiled(layer: Layer, kernel: Kernel, xs: list, profiler) -> list:
    start = perf_counter_ns()
    if layer.inner and hasattr(kernel, "profiled_run"):
        results = kernel.profiled_run(xs)
        profiler.watch_region(layer.name, kernel)
    else:
        results = kernel(xs)
    profiler.record(layer.name, (perf_counter_ns() - start) / 1e6)
    return results
