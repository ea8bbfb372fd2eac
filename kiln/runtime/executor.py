"""Executes a plan on CPU: kernels prepared once per engine (weights shared), state per execution context."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from kiln.errors import EngineFormatError, Error, InputError
from kiln.ops.dtypes import is_float, raw_bfloat16, tensor_from_numpy, tensor_to_numpy
from kiln.plan.model import Plan
from kiln.runtime.interpreter import Interpreter, Kernel, Observer
from kiln.runtime.prepare import TorchWeights, prepare_kernel


def prepare_kernels(plan: Plan) -> list[Kernel]:
    """Turn every layer into a callable; weights become torch tensors (prepacked by the tactic)."""
    weights = TorchWeights(plan.weights)
    opset = plan.build_info.get("opset", 17)
    opset = opset if isinstance(opset, int) else 17   # a hand-edited plan's odd value falls back to the default
    kernels = []
    for layer in plan.layers:
        try:
            kernels.append(prepare_kernel(layer, weights, plan.weights, opset, cached=True))
        except Error:
            raise
        except Exception as exc:   # a plan that parsed but cannot be prepared: a damaged or hand-edited engine
            raise EngineFormatError(f"layer '{layer.name}' ({layer.op_type}) cannot be prepared: "
                                    f"{type(exc).__name__}: {exc}; rebuild the engine") from None
    return kernels


class ExecutionContext:
    """Runs inferences. Each context owns its activations; share one engine across threads, one context each."""

    def __init__(self, plan: Plan, kernels: list[Kernel], profile: int | None, threads: int):
        self.plan, self.kernels, self.threads = plan, kernels, threads
        if profile is not None and not 0 <= profile < max(1, len(plan.profiles)):
            raise InputError(f"optimization profile {profile} does not exist; the engine has "
                             f"{max(1, len(plan.profiles))} (0..{max(1, len(plan.profiles)) - 1})")
        self.profile = profile   # None: the first profile that contains the input shapes
        engine_io = {t.name for t in (*plan.inputs, *plan.outputs)}
        self.interpreter = Interpreter(plan.layers, kernels, keep=engine_io)

    def check_inputs(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        expected = {t.name: t for t in self.plan.inputs}
        unknown = sorted(set(feeds) - set(expected))
        if unknown:
            raise InputError(f"unknown input name(s) {unknown}; the engine's inputs are {sorted(expected)}")
        missing = sorted(set(expected) - set(feeds))
        if missing:
            raise InputError(f"missing input(s) {missing}; the engine's inputs are {sorted(expected)}")
        shapes = {name: tuple(np.shape(feeds[name])) for name in expected}
        check_shapes(self.plan, shapes, self.profile)
        tensors = {}
        for name, desc in expected.items():
            arr = raw_bfloat16(np.asarray(feeds[name])) if desc.dtype == "bfloat16" else np.asarray(feeds[name])
            if arr.dtype != np.dtype(desc.dtype):
                # float->float and int->int convert (numpy defaults to float64); anything else is an error
                if _kind(arr.dtype) != _kind(desc.dtype) or _kind(arr.dtype) not in "fiu":
                    raise InputError(f"input '{name}': dtype {arr.dtype} cannot be used for the engine's "
                                     f"{desc.dtype}; convert it with .astype('{desc.dtype}')")
                arr = arr.astype(desc.dtype)
            tensors[name] = tensor_from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
        return tensors

    def execute(self, feeds: dict[str, np.ndarray], profiler=None, observe: Observer | None = None
                ) -> dict[str, np.ndarray]:
        """Run one inference. `observe(name, tensor)`, if given, sees every tensor a layer produces."""
        env: dict[str, torch.Tensor] = self.check_inputs(feeds)
        with engine_threads(self.threads), torch.inference_mode():
            self.interpreter.run(env, observe, profiler)
        return {t.name: _to_numpy(env[t.name], t.dtype) for t in self.plan.outputs}


@contextlib.contextmanager
def engine_threads(threads: int):
    """The calling thread runs with the engine's thread count for the block, and gets its own back after. OpenMP
    keeps the count per thread: a thread other than the one that set it starts at OpenMP's default, every core,
    and kiln's C kernels size their teams and split their sums by it, so a serving thread would oversubscribe the
    cores and round differently from a serial run."""
    before = torch.get_num_threads()
    if not threads or before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _kind(dtype) -> str:
    """numpy's kind letter, with bfloat16 (ml_dtypes: "V") counted as a float."""
    return "f" if is_float(dtype) else np.dtype(dtype).kind


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    arr = tensor_to_numpy(t.contiguous())
    return arr if arr.dtype == np.dtype(dtype) else arr.astype(dtype)


def check_shapes(plan: Plan, shapes: dict[str, tuple[int, ...]], profile: int | None = None) -> int:
    """The profile the input shapes fall in (0 for static engines); an InputError naming the input, its shape
    and the allowed ranges otherwise."""
    if not plan.profiles:
        for desc in plan.inputs:
            if shapes[desc.name] != desc.dims:
                shape = "x".join(map(str, shapes[desc.name]))
                raise InputError(f"input '{desc.name}': shape {list(shapes[desc.name])} does not match the engine's "
                                 f"{list(desc.dims)} (rebuild with --shapes {desc.name}:{shape}, or with "
                                 "--min-shapes/--opt-shapes/--max-shapes for a dynamic engine)")
        return 0
    indices = range(len(plan.profiles)) if profile is None else [profile]
    for k in indices:
        if all(plan.profiles[k][n].contains(s) for n, s in shapes.items()):
            return k
    k = indices[0]
    bad = next(n for n, s in shapes.items() if not plan.profiles[k][n].contains(s))
    allowed = "; ".join(f"profile {i}: {plan.profiles[i][bad].text()}" for i in indices)
    raise InputError(f"input '{bad}': shape {list(shapes[bad])} is outside the engine's optimization "
                     f"profile{'s' if len(indices) > 1 else ''} ({allowed}); rebuild with a wider "
                     f"--max-shapes/--min-shapes for '{bad}'")
