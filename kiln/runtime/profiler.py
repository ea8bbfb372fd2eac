"""Per-layer profiler and trtexec-compatible profile/times exports and summaries."""
from __future__ import annotations

import json
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


def g6(x: float) -> str:
    """C++ default float formatting (6 significant digits), as trtexec prints numbers."""
    return f"{x:g}"


def profile_json(profiler: LayerProfiler, verbosity: str = "detailed") -> str:
    """trtexec --exportProfile: a count record, then one 5-key record per layer."""
    lines = ["[", f'  {{ "count" : {profiler.count} }}']
    for t in profiler.summary(verbosity):
        lines.append(f'{", "}{{ "name" : {json.dumps(t.name)}, "timeMs" : {g6(t.total_ms)}, '
                     f'"averageMs" : {g6(t.average_ms)}, "medianMs" : {g6(t.median_ms)}, '
                     f'"percentage" : {g6(t.percentage)} }}')
    lines.append("]")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class InferenceTime:
    start_ms: float
    end_ms: float

    @property
    def latency_ms(self) -> float:
        return self.end_ms - self.start_ms


def times_json(times: list[InferenceTime]) -> str:
    """trtexec --exportTimes (TensorRT 8.4+ key set). On CPU there is no H2D/D2H copy: those spans are 0."""
    rows = []
    for i, t in enumerate(times):
        s, e = g6(t.start_ms), g6(t.end_ms)
        sep = "  " if i == 0 else ", "
        rows.append(f'{sep}{{ "startEnqMs" : {s}, "endEnqMs" : {e}, "startH2dMs" : {s}, "endH2dMs" : {s}, '
                    f'"startComputeMs" : {s}, "endComputeMs" : {e}, "startD2hMs" : {e}, "endD2hMs" : {e}, '
                    f'"h2dMs" : 0, "computeMs" : {g6(t.latency_ms)}, "d2hMs" : 0, "latencyMs" : {g6(t.latency_ms)} }}')
    return "[\n" + "\n".join(rows) + ("\n" if rows else "") + "]\n"


def profile_table(profiler: LayerProfiler, verbosity: str = "detailed") -> str:
    """trtexec --dumpProfile console table (TensorRT 8.6/10 layout)."""
    rows = [f"=== Profile ({profiler.count} iterations ) ===",
            "   Time(ms)     Avg.(ms)   Median(ms)   Time(%)   Layer"]
    summary = profiler.summary(verbosity)
    total = sum(t.total_ms for t in summary)
    for t in summary:
        if t.total_ms > 0:
            rows.append(f"{t.total_ms:11.2f}{t.average_ms:13.4f}{t.median_ms:13.4f}{t.percentage:10.1f}   {t.name}")
    per_run = [sum(v[i] for n, v in profiler.times_ms.items() if i < len(v)) for i in range(profiler.count)]
    median = statistics.median(per_run) if per_run else 0.0
    rows.append(f"{total:11.2f}{total / max(profiler.count, 1):13.4f}{median:13.4f}{100.0:10.1f}   Total")
    return "\n".join(rows)


def percentile(sorted_values: list[float], p: float) -> float:
    """trtexec's percentile: drop the top (1 - p/100) share."""
    n = len(sorted_values)
    exclude = int((1 - p / 100) * n)
    return sorted_values[max(n - 1 - exclude, 0)]


def perf_string(values_ms: list[float], percentiles: tuple[float, ...]) -> str:
    v = sorted(values_ms)
    s = (f"min = {g6(v[0])} ms, max = {g6(v[-1])} ms, mean = {g6(sum(v) / len(v))} ms, "
         f"median = {g6(statistics.median(v))} ms")
    for p in percentiles:
        s += f", percentile({g6(p)}%) = {g6(percentile(v, p))} ms"
    return s


def performance_summary(times: list[InferenceTime], percentiles: tuple[float, ...] = (90, 95, 99)) -> list[str]:
    """trtexec's "=== Performance summary ===" block; CPU compute replaces GPU compute, transfers are 0."""
    lat = [t.latency_ms for t in times]
    wall_ms = times[-1].end_ms - times[0].start_ms if times else 0.0
    zeros = [0.0] * len(lat)
    return [
        "=== Performance summary ===",
        f"Throughput: {g6(len(times) / wall_ms * 1000 if wall_ms else 0.0)} qps",
        f"Latency: {perf_string(lat, percentiles)}",
        f"Enqueue Time: {perf_string(lat, percentiles)}",
        f"H2D Latency: {perf_string(zeros, percentiles)}",
        f"GPU Compute Time: {perf_string(lat, percentiles)}",
        f"D2H Latency: {perf_string(zeros, percentiles)}",
        f"Total Host Walltime: {g6(wall_ms / 1000)} s",
        f"Total GPU Compute Time: {g6(sum(lat) / 1000)} s",
        "Note: kiln runs on the CPU; 'GPU Compute Time' reports CPU compute time so trtexec parsers keep working.",
    ]
