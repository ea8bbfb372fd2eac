"""kiln.trt.profile: trtexec's --exportProfile / --exportTimes JSON, --dumpProfile table and performance summary,
written from kiln's measurements in trtexec's exact layout, and read back."""
from __future__ import annotations

from kiln.runtime.profiler import InferenceTime, LayerProfiler
from kiln.trt.build_log import log_prefix
from kiln.trt.build_log_reader import parse_build_log
from kiln.trt.profile import (performance_summary, profile_json, profile_table, read_profile_json, read_times_json,
                              times_json)
from kiln.trt.records import ProfileRecord


def _profiler() -> LayerProfiler:
    """Two inferences of two layers: a takes 1 then 2 ms, b 3 then 2 ms."""
    p = LayerProfiler()
    for a_ms, b_ms in ((1.0, 3.0), (2.0, 2.0)):
        p.record("a", a_ms)
        p.record('b "quoted"', b_ms)
        p.end_inference()
    p.finish()
    return p


def test_profile_json_layout_and_read_back():
    text = profile_json(_profiler())
    assert text == ('[\n  { "count" : 2 }\n'
                    ', { "name" : "a", "timeMs" : 3, "averageMs" : 1.5, "medianMs" : 1.5, "percentage" : 37.5 }\n'
                    ', { "name" : "b \\"quoted\\"", "timeMs" : 5, "averageMs" : 2.5, "medianMs" : 2.5, '
                    '"percentage" : 62.5 }\n]\n')
    profile = read_profile_json(text)
    assert profile.count == 2
    assert profile.records == (ProfileRecord("a", 3.0, 1.5, 1.5, 37.5), ProfileRecord('b "quoted"', 5.0, 2.5, 2.5, 62.5))


def test_times_json_layout_and_read_back():
    text = times_json([InferenceTime(0.0, 1.5), InferenceTime(2.0, 2.25)])
    first, second = text.split("\n")[1:3]
    assert first == ('  { "startEnqMs" : 0, "endEnqMs" : 1.5, "startH2dMs" : 0, "endH2dMs" : 0, "startComputeMs" : 0, '
                     '"endComputeMs" : 1.5, "startD2hMs" : 1.5, "endD2hMs" : 1.5, "h2dMs" : 0, "computeMs" : 1.5, '
                     '"d2hMs" : 0, "latencyMs" : 1.5 }')
    assert second.startswith(', { "startEnqMs" : 2, ') and second.endswith('"latencyMs" : 0.25 }')
    times = read_times_json(text)
    assert times.latency_ms == (1.5, 0.25) and times.compute_ms == (1.5, 0.25) and times.key_set == "trt8.4+"
    assert times_json([]) == "[\n]\n" and read_times_json(times_json([])).latency_ms == ()


def test_profile_table_layout():
    assert profile_table(_profiler()).split("\n") == [
        "=== Profile (2 iterations ) ===",
        "   Time(ms)     Avg.(ms)   Median(ms)   Time(%)   Layer",
        "       3.00       1.5000       1.5000      37.5   a",
        '       5.00       2.5000       2.5000      62.5   b "quoted"',
        "       8.00       4.0000       4.0000     100.0   Total"]


def test_performance_summary_lines_read_back_as_the_section():
    times = [InferenceTime(0.0, 1.0), InferenceTime(1.0, 3.0)]   # latencies 1 and 2 ms over 3 ms
    lines = performance_summary(times, (50, 99))
    assert lines[:3] == ["=== Performance summary ===", "Throughput: 666.667 qps",
                         "Latency: min = 1 ms, max = 2 ms, mean = 1.5 ms, median = 1.5 ms, percentile(50%) = 1 ms, "
                         "percentile(99%) = 2 ms"]
    assert "H2D Latency: min = 0 ms, max = 0 ms" in lines[4]
    assert lines[7:9] == ["Total Host Walltime: 0.003 s", "Total GPU Compute Time: 0.003 s"]
    log = parse_build_log("\n".join(log_prefix("I") + line for line in lines) + "\n", "run.log")
    assert log.performance["Throughput"] == "666.667 qps"
    assert log.performance["Total Host Walltime"] == "0.003 s"
