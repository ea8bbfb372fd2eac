"""Executes a plan on CPU: kernels prepared once per engine (weights shared), state per execution context."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from kiln.engine.plan import Plan
from kiln.errors import InputError
from kiln.tactics.prepare import TorchWeights, prepare_kernel

Kernel = Callable[[list], list]


def prepare_kernels(plan: Plan) -> list[Kernel]:
    """Turn every layer into a callable; weights become torch tensors (prepacked by the tactic)."""
    weights = TorchWeights(plan.weights)
    opset = int(plan.build_info.get("opset", 17))
    return [prepare_kernel(layer, weights, plan.weights, opset) for layer in plan.layers]


class ExecutionContext:
    """Runs inferences. Each context owns its activations; share one engine across threads, one context each."""

    def __init__(self, plan: Plan, kernels: list[Kernel]):
        self.plan, self.kernels = plan, kernels
        self._steps = [(layer, [(a.kind, a.name) for a in layer.args], [t.name for t in layer.outputs],
                        plan.memory.free_after[i]) for i, layer in enumerate(plan.layers)]

    def check_inputs(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        expected = {t.name: t for t in self.plan.inputs}
        unknown = sorted(set(feeds) - set(expected))
        if unknown:
            raise InputError(f"unknown input name(s) {unknown}; the engine's inputs are {sorted(expected)}")
        missing = sorted(set(expected) - set(feeds))
        if missing:
            raise InputError(f"missing input(s) {missing}; the engine's inputs are {sorted(expected)}")
        tensors = {}
        for name, desc in expected.items():
            arr = np.asarray(feeds[name])
            if tuple(arr.shape) != desc.dims:
                raise InputError(f"input '{name}': shape {list(arr.shape)} does not match the engine's "
                                 f"{list(desc.dims)} (rebuild with --shapes {name}:{'x'.join(map(str, arr.shape))})")
            if arr.dtype != np.dtype(desc.dtype):
                # float->float and int->int convert (numpy defaults to float64); anything else is an error
                if arr.dtype.kind != np.dtype(desc.dtype).kind or arr.dtype.kind not in "fiu":
                    raise InputError(f"input '{name}': dtype {arr.dtype} cannot be used for the engine's "
                                     f"{desc.dtype}; convert it with .astype('{desc.dtype}')")
                arr = arr.astype(desc.dtype)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
        return tensors

    def execute(self, feeds: dict[str, np.ndarray], profiler=None) -> dict[str, np.ndarray]:
        env: dict[str, torch.Tensor] = self.check_inputs(feeds)
        with torch.inference_mode():
            for (layer, args, outs, free), kernel in zip(self._steps, self.kernels):
                xs = [env[n] if k == "tensor" else None for k, n in args]
                if profiler is None:
                    results = kernel(xs)
                else:
                    t0 = time.perf_counter_ns()
                    if layer.inner and hasattr(kernel, "profiled_run"):
                        results = kernel.profiled_run(xs)
                        profiler.watch_region(layer.name, kernel)
                    else:
                        results = kernel(xs)
                    profiler.record(layer.name, (time.perf_counter_ns() - t0) / 1e6)
                for n, r in zip(outs, results):
                    env[n] = r
                for n in free:
                    env.pop(n, None)
        return {t.name: _to_numpy(env[t.name], t.dtype) for t in self.plan.outputs}


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    arr = t.contiguous().numpy()
    return arr if arr.dtype == np.dtype(dtype) else arr.astype(dtype)


