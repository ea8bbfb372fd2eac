"""`Engine`: a loaded plan plus its prepared kernels; `run()` for one-off calls, contexts for threads."""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from kiln.ops.dtypes import is_float
from kiln.plan.model import Plan
from kiln.plan.serialize import load_plan, save_plan
from kiln.runtime.executor import ExecutionContext, engine_threads, prepare_kernels
from kiln.trt.layer_info import layer_info


class Engine:
    """A built kiln engine. Thread-safety: `create_execution_context()` per thread; weights are shared."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.threads = torch.get_num_threads()   # when built or loaded (kiln.build(threads=), --threads): every
        # thread running it uses this count (docs/reliability.md); contexts created later take a new value
        self._kernels = None
        self._lock = threading.Lock()
        self._default_context: ExecutionContext | None = None

    @property
    def kernels(self):
        with self._lock:
            if self._kernels is None:
                with engine_threads(self.threads):   # onnxruntime/OpenVINO regions read it as they compile
                    self._kernels = prepare_kernels(self.plan)
            return self._kernels

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.plan.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.plan.outputs]

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.dims for t in self.plan.inputs}

    @property
    def profiles(self) -> list[dict[str, Any]]:
        """Optimization profiles: per profile, input -> ShapeRange(min, opt, max); empty for static engines."""
        return list(self.plan.profiles)

    def create_execution_context(self, profile: int | None = None) -> ExecutionContext:
        """A context for one thread; `profile` pins an optimization profile (default: the first that fits)."""
        return ExecutionContext(self.plan, self.kernels, profile, self.threads)

    def run(self, feeds: dict[str, np.ndarray], profiler=None) -> dict[str, np.ndarray]:
        if self._default_context is None:
            self._default_context = self.create_execution_context()
        return self._default_context.execute(feeds, profiler)

    def first_nonfinite(self, feeds: dict[str, np.ndarray]) -> tuple[str, str, int, int] | None:
        """(layer, tensor, NaN count, Inf count) for the first input or layer output holding NaN/Inf, else None.
        Layers inside an external-library region are seen as one (its outputs)."""
        for name, value in feeds.items():
            arr = np.asarray(value)
            if is_float(arr.dtype) and not np.isfinite(arr).all():   # ml_dtypes' bfloat16 has its own isfinite
                return "(input)", name, int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
        producer = {t.name: l.name for l in self.plan.layers for t in l.outputs}
        found: list = []

        def observe(name, t):
            if not found and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                found.append((producer.get(name, "?"), name, int(torch.isnan(t).sum()), int(torch.isinf(t).sum())))
        self.create_execution_context().execute(feeds, observe=observe)
        return found[0] if found else None

    def random_inputs(self, seed: int = 0, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
        """Random feeds at the opt shapes, or at `shapes` (trtexec's --shapes) for dynamic inputs. Integer inputs
        that index a constant table (token ids into an embedding) stay within it."""
        rng = np.random.default_rng(seed)
        feeds, bounds = {}, index_bounds(self.plan)
        for t in self.plan.inputs:
            dims = tuple((shapes or {}).get(t.name, t.dims))
            if is_float(t.dtype):
                feeds[t.name] = rng.standard_normal(dims).astype(t.dtype)
            elif t.dtype == "bool":
                feeds[t.name] = rng.integers(0, 2, dims).astype(bool)
            else:
                feeds[t.name] = rng.integers(0, min(4, bounds.get(t.name, 4)), dims).astype(t.dtype)
        return feeds

    def save(self, path: str | os.PathLike) -> None:
        save_plan(self.plan, path)

    def layer_info(self, verbosity: str = "detailed", shapes: dict[str, tuple[int, ...]] | None = None,
                   schema: int = 10) -> dict[str, Any]:
        """trtexec's layer info in TensorRT `schema`'s form (10, or 11 with "I/O Tensors" and separate Format and
        Datatype fields). Dynamic dimensions show as -1 unless run-time `shapes` are given (as with trtexec
        --shapes): then one inference at those shapes fills in every tensor kiln can see (tensors inside a region
        keep -1)."""
        if not shapes or not self.plan.profiles:
            return layer_info(self.plan, verbosity, schema)
        seen: dict[str, tuple[int, ...]] = {}
        feeds = self.random_inputs(shapes=shapes)
        seen.update({k: tuple(v.shape) for k, v in feeds.items()})
        self.create_execution_context().execute(feeds, observe=lambda n, t: seen.__setitem__(n, tuple(t.shape)))
        return layer_info(_with_shapes(self.plan, seen), verbosity, schema)

    @property
    def num_layers(self) -> int:
        return len(self.plan.layers)


def _with_shapes(plan: Plan, seen: dict[str, tuple[int, ...]]) -> Plan:
    import dataclasses

    def desc(t):
        return dataclasses.replace(t, dims=seen[t.name], dynamic=()) if t.name in seen else t

    def layer(l):
        return dataclasses.replace(l, inputs=tuple(desc(t) for t in l.inputs), outputs=tuple(desc(t) for t in l.outputs),
                                   inner=tuple(layer(i) for i in l.inner))
    return dataclasses.replace(plan, layers=tuple(layer(l) for l in plan.layers),
                               inputs=tuple(desc(t) for t in plan.inputs), outputs=tuple(desc(t) for t in plan.outputs))


def load(path: str | os.PathLike, allow_other_device: bool = False) -> Engine:
    plan = load_plan(path)
    check_device(plan, str(path), allow_other_device)
    return Engine(plan)


def check_device(plan: Plan, where: str, allow_other_device: bool = False) -> None:
    """Like TensorRT, refuse an engine built on another device: its tactic choices were timed there, and some of
    its kernels may need instruction-set extensions this CPU lacks (named in the message). CPU engines still
    compute correctly elsewhere, so `allow_other_device` loads them anyway with a warning; kernels needing a
    missing extension then run their fallback, one warning each."""
    import logging

    from kiln.errors import EngineFormatError
    from kiln.tactics.timing_cache import device_description

    built = plan.build_info.get("device_description") or {}
    here = device_description(torch.get_num_threads())
    lacking = sorted(set(built.get("isa") or ()) - set(here["isa"]))
    if (not built.get("cpu") or built.get("cpu") == here["cpu"]) and not lacking:
        return
    message = f"{where}: engine was built on '{built.get('cpu')}'" + \
        (f" with {', '.join(lacking)}, which this CPU lacks" if lacking else "") + f"; this machine is '{here['cpu']}'"
    if not allow_other_device:
        raise EngineFormatError(f"{message}. Its kernels were chosen by timing there: rebuild it here, or load it "
                                "anyway with allow_other_device=True (CLI: --allow-other-device)")
    logging.getLogger("kiln").warning("%s; loading anyway (tactic choices may not be the fastest here)", message)


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


def index_bounds(plan: Plan) -> dict[str, int]:
    """{engine input: the length of the smallest constant table it indexes} for inputs read as Gather indices
    (token ids, token types into BERT's 2-row table), also inside regions."""
    inputs, bounds = {t.name for t in plan.inputs}, {}
    for layer in plan.layers:
        for inner in layer.inner or (layer,):
            args = inner.args
            if inner.op_type == "Gather" and len(args) > 1 and args[0].kind == "weight" and \
                    args[1].kind == "tensor" and args[1].name in inputs:
                length = plan.weights[args[0].name].shape[inner.attrs.get("axis", 0)]
                bounds[args[1].name] = min(bounds.get(args[1].name, length), length)
    return bounds
