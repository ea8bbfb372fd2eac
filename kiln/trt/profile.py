"""trtexec's profile and times: the --exportProfile / --exportTimes JSON writers beside their readers, the
--dumpProfile table and the "=== Performance summary ===" lines. The writers take kiln's measurements as
`kiln.runtime.profiler` collects them (any object with the same fields will do)."""
from __future__ import annotations

import json
import re
import statistics
from typing import Any, Protocol, Sequence

from kiln.errors import ArtifactError
from kiln.trt.reading import artifact_error, as_json, number
from kiln.trt.build_log import PERFORMANCE_SUMMARY, section_header
from kiln.trt.records import InferenceTimes, Profile, ProfileRecord


class LayerTiming(Protocol):
    """One layer's times over the profiled inferences (kiln.runtime.profiler.LayerTime)."""

    name: str
    total_ms: float
    average_ms: float
    median_ms: float
    percentage: float


class LayerTimings(Protocol):
    """Per-layer times of profiled inferences (kiln.runtime.profiler.LayerProfiler)."""

    count: int
    times_ms: dict[str, list[float]]

    def summary(self, verbosity: str = ...) -> Sequence[LayerTiming]: ...


class InferenceSpan(Protocol):
    """One timed inference (kiln.runtime.profiler.InferenceTime)."""

    start_ms: float
    end_ms: float

    @property
    def latency_ms(self) -> float: ...


def g6(x: float) -> str:
    """C++ default float formatting (6 significant digits), as trtexec prints numbers."""
    return f"{x:g}"


# ---- --exportProfile -----------------------------------------------------------------------------------------------

def profile_json(profiler: LayerTimings, verbosity: str = "detailed") -> str:
    """trtexec --exportProfile: a count record, then one 5-key record per layer."""
    lines = ["[", f'  {{ "count" : {profiler.count} }}']
    for t in profiler.summary(verbosity):
        lines.append(f'{", "}{{ "name" : {json.dumps(t.name)}, "timeMs" : {g6(t.total_ms)}, '
                     f'"averageMs" : {g6(t.average_ms)}, "medianMs" : {g6(t.median_ms)}, '
                     f'"percentage" : {g6(t.percentage)} }}')
    lines.append("]")
    return "\n".join(lines) + "\n"


# one record line of a profile as trtexec writes it (names unescaped), for profiles whose names broke JSON
PROFILE_COUNT_LINE = re.compile(r'^\{ "count" : (\d+) \}$')
PROFILE_RECORD_LINE = re.compile(r'^\s*,?\s*\{ "name" : "(?P<name>.*)", "timeMs" : (?P<t>[^,]+), '
                                 r'"averageMs" : (?P<a>[^,]+)(?:, "medianMs" : (?P<m>[^,]+))?, '
                                 r'"percentage" : (?P<p>[^ ]+) \}\s*$')


def read_profile_json(text: str | list, where: str = "<profile>") -> Profile:
    """trtexec --exportProfile: `[{"count": N}, {"name", "timeMs", "averageMs", ["medianMs",] "percentage"}, ...]`."""
    try:
        doc = as_json(text, where)
    except ArtifactError:
        doc = profile_lines(text) if isinstance(text, str) else None   # names written raw (unescaped quotes)
        if doc is None:
            raise
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise artifact_error(where, "not a profile (expected a JSON list of records)",
                             "expected the output of trtexec --exportProfile")
    count, records = None, []
    for i, r in enumerate(doc):
        if set(r) == {"count"}:
            count = number(r["count"], where, i, int)
            continue
        if not {"name", "timeMs", "averageMs", "percentage"} <= set(r):
            raise artifact_error(where, f"profile record #{i} lacks name/timeMs/averageMs/percentage",
                                 "expected the output of trtexec --exportProfile")
        median = r.get("medianMs")
        records.append(ProfileRecord(str(r["name"]), number(r["timeMs"], where, i), number(r["averageMs"], where, i),
                                     None if median is None else number(median, where, i),
                                     number(r["percentage"], where, i)))
    return Profile(count, tuple(records))


def profile_lines(text: str) -> list[dict] | None:
    """Line-by-line reading of a profile whose layer names broke JSON (trtexec does not escape them)."""
    rows: list[dict] = []
    for line in text.split("\n"):
        s = line.strip()
        if s in ("[", "]", ""):
            continue
        if (m := PROFILE_COUNT_LINE.match(s)):
            rows.append({"count": int(m[1])})
        elif (m := PROFILE_RECORD_LINE.match(line)):
            row = {"name": m["name"], "timeMs": m["t"], "averageMs": m["a"], "percentage": m["p"]}
            rows.append(row | ({"medianMs": m["m"]} if m["m"] else {}))
        else:
            return None
    return rows if rows and text.rstrip().endswith("]") else None


# ---- --exportTimes -------------------------------------------------------------------------------------------------

def times_json(times: Sequence[InferenceSpan]) -> str:
    """trtexec --exportTimes (TensorRT 8.4+ key set). On CPU there is no H2D/D2H copy: those spans are 0."""
    rows = []
    for i, t in enumerate(times):
        s, e = g6(t.start_ms), g6(t.end_ms)
        sep = "  " if i == 0 else ", "
        rows.append(f'{sep}{{ "startEnqMs" : {s}, "endEnqMs" : {e}, "startH2dMs" : {s}, "endH2dMs" : {s}, '
                    f'"startComputeMs" : {s}, "endComputeMs" : {e}, "startD2hMs" : {e}, "endD2hMs" : {e}, '
                    f'"h2dMs" : 0, "computeMs" : {g6(t.latency_ms)}, "d2hMs" : 0, "latencyMs" : {g6(t.latency_ms)} }}')
    return "[\n" + "\n".join(rows) + ("\n" if rows else "") + "]\n"


# the key that tells each TensorRT version's times export apart
TIMES_KEY_SETS = (("startInMs", "trt7"), ("endToEndMs", "trt8.0-8.3"), ("startH2dMs", "trt8.4+"))


def read_times_json(text: str | list, where: str = "<times>") -> InferenceTimes:
    """trtexec --exportTimes: one record per inference; key sets of TRT 8.4+ (12 keys), 8.0-8.3 (+endToEndMs), 7.x
    (startInMs ...). An empty list reads as an empty 8.4+ set."""
    doc: Any = as_json(text, where)
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise artifact_error(where, "not a times export (expected a JSON list of records)",
                             "expected the output of trtexec --exportTimes")
    key_set = "trt8.4+"
    if doc:
        key_set = next((name for key, name in TIMES_KEY_SETS if key in doc[0]), None)
        if key_set is None or not all({"latencyMs", "computeMs"} <= set(r) for r in doc):
            raise artifact_error(where, "records lack latencyMs/computeMs (or the start*Ms keys of a known TensorRT "
                                        "version)", "expected the output of trtexec --exportTimes")
    return InferenceTimes(tuple(number(r["latencyMs"], where, i) for i, r in enumerate(doc)),
                          tuple(number(r["computeMs"], where, i) for i, r in enumerate(doc)), key_set)


# ---- console: --dumpProfile and the performance summary ------------------------------------------------------------

def profile_table(profiler: LayerTimings, verbosity: str = "detailed") -> str:
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


def performance_summary(times: Sequence[InferenceSpan], percentiles: tuple[float, ...] = (90, 95, 99)) -> list[str]:
    """trtexec's "=== Performance summary ===" block; CPU compute replaces GPU compute, transfers are 0."""
    lat = [t.latency_ms for t in times]
    wall_ms = times[-1].end_ms - times[0].start_ms if times else 0.0
    zeros = [0.0] * len(lat)
    return [
        section_header(PERFORMANCE_SUMMARY),
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
