"""The models a server serves: each engine with its name, version, protocol metadata, request validation,
batcher and counters; `ModelRepository` finds them by name and version for every transport."""
from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import InputError
from kiln.runtime.executor import check_shapes
from kiln.serve.batcher import Batcher, BatchPolicy
from kiln.serve.datatypes import oip_datatype
from kiln.serve.metrics import ModelStats
from kiln.serve.protocol import InferOutput, InferRequest, InferResponse, ModelNotFoundError

PLATFORM = "kiln_engine"
VERSION = "1"
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ServeOptions:
    """How every model is served. `max_batch_size` None: up to the optimization profile's batch maximum."""

    max_batch_size: int | None = None
    max_queue_delay_us: int = 0
    instances: int = 1
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def serving_threads(instances: int, cores: int | None = None) -> int:
    """Intra-op threads per inference when `kiln serve --threads` is not given: the usable cores less one for the
    event loop (request decoding, responses), shared among the instances, at least 1. A parallel region with a
    thread per core stalls at its barrier whenever any other thread (the loop, a client, a neighbour) takes one
    of those cores: on 2 cores, 2 threads made the conv net's batched runs 10x slower (docs/serving.md)."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, (cores - 1) // max(1, instances))


@dataclass(frozen=True)
class TensorSpec:
    """An engine input or output as the protocol describes it; `shape` has -1 on dynamic axes."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class ServedModel:
    """One engine behind the protocol (version "1"). `infer` validates, queues and awaits the batcher."""

    def __init__(self, name: str, engine, options: ServeOptions):
        self.name, self.version, self.engine = name, VERSION, engine
        self.inputs = tuple(TensorSpec(t.name, oip_datatype(t.dtype), t.shape_spec) for t in engine.plan.inputs)
        self.outputs = tuple(TensorSpec(t.name, oip_datatype(t.dtype), t.shape_spec) for t in engine.plan.outputs)
        self.policy = BatchPolicy(batch_limit(engine.plan, options.max_batch_size), options.max_queue_delay_us)
        self.instances = options.instances
        self.stats = ModelStats()
        self.batcher: Batcher | None = None

    def start(self) -> None:
        if self.batcher is None:
            self.batcher = Batcher(self.engine, self.policy, self.stats, self.instances, self.name)

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()

    @property
    def ready(self) -> bool:
        return self.batcher is not None and self.batcher.accepting

    def metadata(self) -> dict:
        return {"name": self.name, "versions": [self.version], "platform": PLATFORM,
                "inputs": [t.metadata() for t in self.inputs], "outputs": [t.metadata() for t in self.outputs]}

    def config(self) -> dict:
        """Triton's model configuration (JSON form), for `tritonclient`'s get_model_config and for people."""
        batching = self.policy.max_batch_size > 1

        def tensor(t: TensorSpec) -> dict:
            dims = t.shape[1:] if batching else t.shape
            return {"name": t.name, "data_type": f"TYPE_{'STRING' if t.datatype == 'BYTES' else t.datatype}",
                    "dims": list(dims)}
        config = {"name": self.name, "platform": PLATFORM, "max_batch_size": self.policy.max_batch_size if batching
                  else 0, "input": [tensor(t) for t in self.inputs], "output": [tensor(t) for t in self.outputs],
                  "instance_group": [{"kind": "KIND_CPU", "count": self.instances}]}
        if batching:
            config["dynamic_batching"] = {"max_queue_delay_microseconds": self.policy.max_queue_delay_us}
        return config

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one request through the batcher; a cancelled await (client gone) drops it if still queued."""
        start_ns = time.perf_counter_ns()
        ok = False
        try:
            feeds = self.validate(request)
            future = self.batcher.submit(feeds)
            try:
                outputs = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                future.cancel()
                raise
            wanted = [o.name for o in request.outputs] or [t.name for t in self.outputs]
            datatypes = {t.name: t.datatype for t in self.outputs}
            response = InferResponse(self.name, self.version, tuple(InferOutput(n, datatypes[n], outputs[n])
                                                                      for n in wanted), request.id)
            ok = True
            return response
        finally:
            self.stats.request_done(ok, (time.perf_counter_ns() - start_ns) / 1000)

    def validate(self, request: InferRequest) -> dict[str, np.ndarray]:
        """The feeds, or an InputError naming the input or output at fault and what the model expects."""
        specs = {t.name: t for t in self.inputs}
        names = [i.name for i in request.inputs]
        for name in names:
            if name not in specs:
                raise InputError(f"unknown input '{name}' for model '{self.name}'; its inputs are {sorted(specs)}")
            if names.count(name) > 1:
                raise InputError(f"input '{name}' is given more than once")
        missing = sorted(set(specs) - set(names))
        if missing:
            raise InputError(f"missing input(s) {missing} for model '{self.name}'; its inputs are {sorted(specs)}")
        outputs = {t.name for t in self.outputs}
        for wanted in request.outputs:
            if wanted.name not in outputs:
                raise InputError(f"unknown output '{wanted.name}' requested from model '{self.name}'; its outputs "
                                 f"are {sorted(outputs)}")
        for item in request.inputs:
            self._check_input(specs[item.name], item.datatype, tuple(item.array.shape))
        feeds = {i.name: i.array for i in request.inputs}
        check_shapes(self.engine.plan, {n: a.shape for n, a in feeds.items()})   # inputs' profiles agree
        return feeds

    def _check_input(self, spec: TensorSpec, datatype: str, shape: tuple[int, ...]) -> None:
        where = f"input '{spec.name}'"
        if datatype != spec.datatype:
            raise InputError(f"{where}: datatype {datatype} does not match the model's {spec.datatype}")
        if len(shape) != len(spec.shape):
            raise InputError(f"{where}: shape {list(shape)} has rank {len(shape)}; the model expects rank "
                             f"{len(spec.shape)} {list(spec.shape)}")
        ranges = [p[spec.name] for p in self.engine.plan.profiles]
        if not ranges:
            if shape != tuple(spec.shape):
                raise InputError(f"{where}: shape {list(shape)} does not match the model's {list(spec.shape)}")
        elif not any(r.contains(shape) for r in ranges):
            allowed = "; ".join(f"profile {i}: {r.text()}" for i, r in enumerate(ranges))
            raise InputError(f"{where}: shape {list(shape)} is outside the model's optimization profile ({allowed})")
        if self.policy.max_batch_size > 1 and shape[0] > self.policy.max_batch_size:
            raise InputError(f"{where}: batch size {shape[0]} exceeds the model's max batch size "
                             f"{self.policy.max_batch_size}")


def batch_limit(plan, requested: int | None) -> int:
    """Rows per execution: 1 unless every input and output's first axis is dynamic; then the largest batch
    every input's profile allows, capped by `requested` (--max-batch-size)."""
    tensors = (*plan.inputs, *plan.outputs)
    if not plan.profiles or not all(0 in t.dynamic for t in tensors):
        return 1
    profile_max = min(max(p[t.name].max[0] for p in plan.profiles) for t in plan.inputs)
    return max(1, min(profile_max, requested if requested else math.inf))


class ModelRepository:
    """The served models by name; lookups raise ModelNotFoundError naming what is served."""

    def __init__(self, models: list[ServedModel], options: ServeOptions):
        self.models = {m.name: m for m in models}
        self.options = options

    @classmethod
    def load(cls, specs: list[tuple[str, str | Path]], options: ServeOptions,
             allow_other_device: bool = False) -> "ModelRepository":
        """Engines from (name, path) pairs; an engine's kernels are prepared here, before any port opens."""
        from kiln.runtime.engine import load

        models = []
        for name, path in specs:
            engine = load(path, allow_other_device)
            engine.kernels   # prepare (prepack weights, load compiled kernels) now, not on the first request
            models.append(ServedModel(name, engine, options))
        return cls(models, options)

    def start(self) -> None:
        for model in self.models.values():
            model.start()

    def stop(self) -> None:
        for model in self.models.values():
            model.stop()

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.models.values())

    def get(self, name: str, version: str = "") -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(f"unknown model '{name}'; this server serves {sorted(self.models)}")
        if version not in ("", model.version):
            raise ModelNotFoundError(f"model '{name}' has no version '{version}'; its versions are "
                                     f"['{model.version}']")
        return model
