"""kiln.trt.build_log: each verbose build-log line kiln writes, in TensorRT's exact wording, read back by the pattern
beside it; a log written only by these writers, read by the whole-log and layer-dump readers."""
from __future__ import annotations

import time

import pytest

from kiln.plan.model import HWC, TensorDesc
from kiln.trt import build_log as lines
from kiln.trt.build_log_reader import parse_build_log, strip_prefix
from kiln.trt.readers import read_oneline
from kiln.trt.records import PassEvent, TacticChoice, TensorInfo

X = TensorDesc("x", (1, 3, 8, 8), "float32", dynamic=(0,))
Y = TensorDesc("y q", (1, 4, 8, 8), "int8", HWC)

WRITTEN = [   # (written line, its exact text, the pattern that reads it, the groups it reads)
    (lines.running("ConvReluFusion", "conv 1"), "Running: ConvReluFusion on conv 1", lines.RUNNING,
     ("ConvReluFusion", "conv 1")),
    (lines.fusing("ConvReluFusion", "a/b", "c + d"), "ConvReluFusion: Fusing a/b with c + d", lines.FUSING,
     ("ConvReluFusion", "a/b", "c + d")),
    (lines.not_fusing("GemmActFusion", "mm", "relu", "mm's output 'm' has 2 consumers"),
     "GemmActFusion: Not fusing mm with relu: mm's output 'm' has 2 consumers", lines.NOT_FUSING,
     ("GemmActFusion", "mm", "relu", "mm's output 'm' has 2 consumers")),
    (lines.removing("Identity_0"), "Removing Identity_0", lines.REMOVING, ("Identity_0",)),
    (lines.pass_note("GeluFusion", "2 rejected"), "GeluFusion: 2 rejected", lines.PASS_NOTE,
     ("GeluFusion", "2 rejected")),
    (lines.skipping_disabled("ConvScaleFusion"), "Skipping ConvScaleFusion (disabled)", lines.SKIPPING,
     ("ConvScaleFusion",)),
    (lines.original_layers(20), "Original: 20 layers", lines.ORIGINAL, ("20",)),
    (lines.after_layers("vertical fusions", 10), "After vertical fusions: 10 layers", lines.AFTER,
     ("vertical fusions", "10")),
    (lines.after_layers("region formation", 3, "1 onnxruntime region(s)"),
     "After region formation: 3 layers (1 onnxruntime region(s))", lines.AFTER, ("region formation", "3")),
    (lines.computing_costs("conv1"), "=============== Computing costs for conv1", lines.COMPUTING_COSTS,
     ("conv1",)),
    (lines.timing_runner("conv1", "OneDnnConvolution"), "--------------- Timing Runner: conv1 (OneDnnConvolution)",
     lines.TIMING_RUNNER, ("conv1", "OneDnnConvolution")),
    (lines.tactic_time("kiln.gemm", 0x1f, 0.0123456), "Tactic Name: kiln.gemm Tactic: 0x000000000000001f Time: 0.0123456",
     lines.TACTIC_TIME, ("kiln.gemm", "0x000000000000001f", "0.0123456")),
    (lines.chose_runner("OneDnnConvolution", 0x1f),
     ">>>>>>>>>>>>>>> Chose Runner Type: OneDnnConvolution Tactic: 0x000000000000001f", lines.CHOSE_RUNNER,
     ("OneDnnConvolution", "0x000000000000001f")),
    (lines.total_activation_memory(4096, 8192), "Total Activation Memory: 4096 bytes (8192 bytes without reuse)",
     lines.MEMORY[2], ("Total Activation Memory", "4096 bytes (8192 bytes without reuse)")),
    (lines.total_weights_memory(311336), "Total Weights Memory: 311336 bytes", lines.MEMORY[2],
     ("Total Weights Memory", "311336 bytes")),
    (lines.section_header(lines.PERFORMANCE_SUMMARY), "=== Performance summary ===", lines.SECTION_HEADER,
     ("Performance summary",)),
]


@pytest.mark.parametrize("written, text, pattern, groups", WRITTEN, ids=[w[1][:40] for w in WRITTEN])
def test_each_line_is_tensorrt_wording_and_reads_back(written, text, pattern, groups):
    assert written == text
    m = pattern.match(written)
    assert m is not None and m.groups()[:len(groups)] == groups


def test_timing_lines_and_build_summary_lines():
    assert lines.optimization_completed(0.0123) == "Graph construction and optimization completed in 0.012300 seconds."
    assert lines.engine_built(1.5) == "Engine built in 1.50000 sec."
    assert lines.tactic_time("t", 1, 2e-05).endswith("Time: 2e-05")


def test_engine_layer_line_reads_back_with_its_tensors():
    text = lines.engine_layer("OneDnnConvolution", "conv + relu", 0xAB, [X], [Y])
    assert text == "Layer(OneDnnConvolution): conv + relu, Tactic: 0x00000000000000ab, x[Float(-1,3,8,8)] -> " \
                   "y q[Int8(1,4,8,8)]"
    m = lines.ENGINE_LAYER_FIELDS.match(text)
    assert (m["type"], m["name"], m["tactic"]) == ("OneDnnConvolution", "conv + relu", "0x00000000000000ab")
    assert lines.ENGINE_LAYER.match(text)
    no_inputs = lines.engine_layer("Constant", "c", 0, [], [X])
    assert no_inputs == "Layer(Constant): c, Tactic: 0x0000000000000000,  -> x[Float(-1,3,8,8)]"


def test_log_prefix_is_stripped():
    when = time.mktime((2026, 11, 23, 9, 5, 7, 0, 0, -1))
    assert lines.log_prefix("V", when) == "[11/23/2026-09:05:07] [V] "
    line = lines.log_prefix("V", when) + lines.KILN_TAG + lines.removing("a")
    assert strip_prefix(line) == ("Removing a", True)
    assert lines.LOG_PREFIX.sub("", line, count=1) == "Removing a"
    assert lines.DATED.match(line)


def _kiln_log() -> str:
    """A verbose build as kiln logs it, every message from the writers."""
    messages = [lines.APPLYING_OPTIMIZATIONS, lines.original_layers(3), lines.running("ConvReluFusion", "conv"),
                lines.fusing("ConvReluFusion", "conv", "relu"),
                lines.not_fusing("GemmActFusion", "mm", "gelu", "no GELU epilogue"),
                lines.after_layers("vertical fusions", 2), lines.skipping_disabled("ConvScaleFusion"),
                lines.optimization_completed(0.01), lines.computing_costs("conv + relu"),
                lines.timing_runner("conv + relu", "OneDnnConvolution"),
                lines.tactic_time("onednn.conv", 0x10, 0.5),
                lines.timing_runner("conv + relu", "Convolution"), lines.tactic_time("kiln.conv", 0x20, 0.25),
                lines.chose_runner("Convolution", 0x20), lines.ENGINE_LAYER_INFORMATION,
                lines.engine_layer("Convolution", "conv + relu", 0x20, [X], [Y]),
                lines.total_activation_memory(100, 200), lines.total_weights_memory(300), lines.engine_built(0.5)]
    when = time.mktime((2026, 11, 23, 9, 5, 7, 0, 0, -1))
    return "\n".join(lines.log_prefix("V", when) + lines.KILN_TAG + m for m in messages) + "\n"


def test_a_log_written_by_kiln_reads_back_as_its_facts():
    log = parse_build_log(_kiln_log(), "kiln.log")
    assert log.layer_trajectory == (("Original", 3), ("After vertical fusions", 2))
    assert log.pass_counts == {"ConvReluFusion": 1}
    assert PassEvent("ConvReluFusion", "fusing", ("conv", "relu")) in log.events
    assert PassEvent("GemmActFusion", "not_fused", ("mm", "gelu", "no GELU epilogue")) in log.events
    assert PassEvent("ConvScaleFusion", "skipped", ()) in log.events
    assert log.timings == (("conv + relu (OneDnnConvolution)", "onednn.conv", 0.5),
                           ("conv + relu (Convolution)", "kiln.conv", 0.25))
    assert log.tactic_choices == (TacticChoice("conv + relu", "Convolution", "0x0000000000000020", 0.25),)
    assert log.memory == {"Total Activation Memory": "100 bytes (200 bytes without reuse)",
                          "Total Weights Memory": "300 bytes"}
    assert log.engine is not None and [l.name for l in log.engine.layers] == ["conv + relu"]


def test_the_engine_layer_dump_reads_back_its_tensors():
    info = read_oneline(_kiln_log(), "kiln.log")
    [layer] = info.layers
    assert (layer.layer_type, layer.tactic_value) == ("Convolution", "0x0000000000000020")
    assert layer.inputs == (TensorInfo("x", (-1, 3, 8, 8), "Float"),)
    assert layer.outputs == (TensorInfo("y q", (1, 4, 8, 8), "Int8"),)
    assert (layer.inputs[0].precision, layer.outputs[0].precision) == ("FP32", "INT8")
