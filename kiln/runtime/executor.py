"""Executes a plan on CPU: kernels prepared once per engine (weights shared), state per execution context."""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import torch

from kiln.engine.plan import Plan
from kiln.errors import EngineFormatError, InputError
from kiln.ops.dtypes import to_torch_dtype
from kiln.tactics import TACTICS_BY_NAME, LayerView
from kiln.tactics.reformat import NOOP_TACTIC, REFORMAT_TACTIC, prepare_reformat

Kernel = Callable[[list], list]


def prepare_kernels(plan: Plan) -> list[Kernel]:
    """Turn every layer into a callable; weights become torch tensors (prepacked by the tactic)."""
    weights = {k: torch.from_numpy(np.array(v)) for k, v in plan.weights.items()}
    kernels: list[Kernel] = []
    for layer in plan.layers:
        if layer.tactic_name in (REFORMAT_TACTIC, NOOP_TACTIC):
            kernels.append(prepare_reformat(layer.attrs["target_format"]))
            continue
        if layer.tactic_name == "kiln.constant":
            value = weights[layer.args[0].name]
            kernels.append(lambda xs, value=value: [value])
            continue
        tactic = TACTICS_BY_NAME.get(layer.tactic_name)
        if tactic is None:
            raise EngineFormatError(f"layer '{layer.name}' uses tactic '{layer.tactic_name}', unknown to this kiln; "
                                    "rebuild the engine")
        shapes = {t.name: t for t in layer.inputs}
        view = LayerView(layer.op_type, layer.domain, layer.attrs,
                         tuple(_arg_shape(a, shapes, plan) for a in layer.args),
                         tuple(_arg_dtype(a, shapes, plan) for a in layer.args),
                         {i: weights[a.name] for i, a in enumerate(layer.args) if a.kind == "weight"},
                         tuple(t.dtype for t in layer.outputs), int(plan.build_info.get("opset", 17)))
        kernels.append(tactic.prepare(view))
    return kernels


def _arg_shape(a, shapes, plan):
    if a.kind == "tensor":
        return shapes[a.name].dims
    if a.kind == "weight":
        return tuple(plan.weights[a.name].shape)
    return None


def _arg_dtype(a, shapes, plan):
    if a.kind == "tensor":
        return shapes[a.name].dtype
    if a.kind == "weight":
        return str(plan.weights[a.name].dtype)
    return None


class ExecutionContext:
    """Runs inferences. Each context owns its activations; share one engine across threads, one context each."""

    def __init__(self, plan: Plan, kernels: list[Kernel]):
        self.plan, self.kernels = plan, kernels
        self._steps = [(layer, [(a.kind, a.name) for a in layer.args], [t.name for t in layer.outputs],
                        plan.memory.free_after[i]) for i, layer in enumerate(plan.layers)]
        self._thread = None

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


_PREPARE_LOCK = threading.Lock()
