"""The per-layer profiler and the times kiln measures (per layer, per inference); trtexec's exports and summaries
of them are written by `kiln.trt.profile`."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerTime:
    name: str
    total_ms: float
    average_ms: float
    median_ms: float
    percentage: float


class LayerProfiler:
    """Collects each layer's time per inference, in layer order."""

    def __init__(self):
        self.times_ms: dict[str, list[float]] = {}
        self.count = 0
        self.regions: dict[str, object] = {}            # region layer -> its kernel, while profiling
        self.inner_ms: dict[str, dict[str, list[float]]] = {}

    def record(self, name: str, ms: float) -> None:
        self.times_ms.setdefault(name, []).append(ms)

    def watch_region(self, name: str, kernel) -> None:
        self.regions[name] = kernel

    def end_inference(self) -> None:
        self.count += 1

    def finish(self) -> None:
        """Collect the per-inner-layer times of profiled regions (onnxruntime's own node profiler)."""
        for name, kernel in self.regions.items():
            self.inner_ms[name] = kernel.end_profiling()
        self.regions = {}

    def summary(self, verbosity: str = "layer_names_only") -> list[LayerTime]:
        """Per layer; at `detailed`, a region's entry is replaced by its inner layers (their kernel times)."""
        series: dict[str, list[float]] = {}
        for name, values in self.times_ms.items():
            inner = self.inner_ms.get(name) if verbosity == "detailed" else None
            if inner:
                series.update(inner)
            else:
                series[name] = values
        total = sum(sum(v) for v in series.values()) or 1.0
        return [LayerTime(n, sum(v), sum(v) / len(v), statistics.median(v), sum(v) / total * 100)
                for n, v in series.items() if v]


@dataclass(frozen=True)
class InferenceTime:
    start_ms: float
    end_ms: float

    @property
    def latency_ms(self) -> float:
        return self.end_ms - self.start_ms
