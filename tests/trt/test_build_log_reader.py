"""parse_build_log on a real TensorRT 8.4.12 log excerpt, TRT 10 / TRT 7 snippets and a real kiln build log."""
from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.errors import ArtifactError
from kiln.trt.build_log_reader import parse_build_log, strip_prefix
from kiln.trt.records import TacticChoice
from tests.conftest import make_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFORMAT = "Optimizer Reformat(<in> -> (Unnamed Layer* 689) [Shuffle]_output)"


@pytest.fixture(scope="module")
def yolo():
    path = FIXTURES / "yolov8_qdq_trt8.4_verbose.excerpt.log"
    return parse_build_log(path.read_text(encoding="utf-8"), str(path))


def test_yolo_version_options_device(yolo):
    assert yolo.tool_version == "TensorRT 8.4.12"
    assert yolo.options["Precision"] == "FP32+INT8"
    assert yolo.options["avgTiming"] == "8"
    assert yolo.options["minTiming"] == "1"
    assert yolo.options["Format"] == "ONNX"            # from the "=== Model Options ===" line missing its "["
    assert yolo.options["Save engine"] == "yolov8_test_qdq.onnxINT8.engine"
    assert yolo.options["Dump refittable layers"] == "Disabled"
    assert yolo.options["Percentile"] == "99"
    assert yolo.options["Streams"] == "1"
    assert yolo.options["Memory Pools"].startswith("workspace: default, dlaSRAM")
    assert yolo.device["Selected Device"] == "Orin"
    assert yolo.device["Compute Capability"] == "8.7"
    assert yolo.device["SMs"] == "16"
    assert "TensorRT version" not in yolo.device
    assert yolo.performance == {}


def test_yolo_trajectory(yolo):
    assert yolo.layer_trajectory == (
        ("Original", 755), ("After dead-layer removal", 755), ("After dupe layer removal", 153),
        ("After final dead-layer removal", 153), ("After tensor merging", 153))


def test_yolo_pass_counts(yolo):
    assert yolo.pass_counts == {
        "ConstShuffleFusion": 1, "ShuffleShuffleFusion": 1, "ConstQDQInitializersFusion": 14,
        "ScaleActivationFusion": 4, "ConstWeightsQuantizeFusion": 3, "ConvReluFusion": 3,
        "SplitQAcrossPrecedingFanIn": 5, "VanillaSwapWithFollowingQ": 3, "HorizontalMergeQNodes": 2,
        "PointWiseFusion": 1, "QConvScaleFusion": 2, "QuantizeDoubleInputNodes": 3, "ConstWeightsFusion": 2,
        "QDQToCopy": 3, "EltwiseAddToPwn": 2}


def _kinds(log):
    counts: dict[str, int] = {}
    for e in log.events:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    return counts


def test_yolo_events(yolo):
    assert _kinds(yolo) == {"running": 49, "fusing": 20, "removing": 15, "swapping": 4, "eliminating": 2,
                            "swap_type": 5, "merging": 5, "eliminating_slice": 3, "eliminating_concat": 2,
                            "retargeting": 4, "generating_copy": 1}
    copy = next(e for e in yolo.events if e.kind == "generating_copy")
    assert copy.pass_name == "concat removal"
    assert copy.subjects == ("/model/taskhead22/Div_1_output_0", "/model/taskhead22/Concat_10_output_0",
                             "of stomping hazard")
    fusing = [e for e in yolo.events if e.kind == "fusing"]
    assert fusing[0].pass_name == "ConstShuffleFusion"
    assert fusing[0].subjects == ("/model/taskhead22/Squeeze_output_0", "(Unnamed Layer* 635) [Shuffle]")
    qdin = [e for e in fusing if e.pass_name == "QuantizeDoubleInputNodes"]
    assert len(qdin) == 6
    assert qdin[1].subjects == ("/model/backbone0/conv/_input_quantizer/DequantizeLinear",
                                "/model/backbone0/conv/_weight_quantizer/DequantizeLinear", "/model/backbone0/conv/Conv")
    dup = next(e for e in yolo.events if e.kind == "eliminating")
    assert dup.pass_name == "HorizontalMergeQNodes"
    assert dup.subjects[1] == "/model/backbone2/m.0/cv1/conv/_input_quantizer/QuantizeLinear"
    swap = [e for e in yolo.events if e.kind == "swap_type"]
    assert swap[0].pass_name == "QDQToCopy" and swap[0].subjects[1:] == ("QUANTIZE", "kQDQ")
    assert swap[-1].pass_name == "EltwiseAddToPwn" and swap[-1].subjects[1:] == ("ELEMENTWISE", "POINTWISE")
    merges = [e for e in yolo.events if e.kind == "merging"]
    assert [len(m.subjects) for m in merges] == [3, 2, 2, 2, 2]
    removing = [e for e in yolo.events if e.kind == "removing"]
    assert removing[0].pass_name == "ConstQDQInitializersFusion"


def test_yolo_tactics_memory_notes(yolo):
    assert len(yolo.timings) == 6
    assert yolo.timings[0] == (f"{REFORMAT} (Reformat)", "0x00000000000003e8", 0.00582967)
    assert yolo.timings[-1] == (f"{REFORMAT} (Reformat)", "0x0000000000000000", 0.00603105)
    # the excerpt drops the Myelin timing lines: the layer is the last one timed, the time unknown
    assert yolo.tactic_choices == (TacticChoice(REFORMAT, "Myelin", "0x0000000000000000", None),)
    assert yolo.memory["Total per-runner device persistent memory"] == "130560"
    assert yolo.memory["Total per-runner host persistent memory"] == "168256"
    assert yolo.memory["activation device memory"] == "39865856"
    assert yolo.memory["MemUsageChange Init CUDA"] == "CPU +0, GPU +0, now: CPU 1606, GPU 13551 (MiB)"
    # the log's detailed "Layers:" dump is read by the one-line reader: Myelin, a QDQ Reformat, a convolution
    assert yolo.engine is not None and [l.layer_type for l in yolo.engine.layers] == ["Myelin", "Reformat",
                                                                                       "CaskConvolution"]
    notes = " | ".join(yolo.notes)
    assert "2 'Layer(...)' line(s)" in notes and "3 'Name: ...' line(s)" in notes
    assert "6 line(s) contain non-ASCII" in notes
    assert "--verbose" not in notes


TRT10 = """\
[11/01/2024-10:32:48] [V] [TRT] Original: 32 layers
[11/01/2024-10:32:48] [V] [TRT] After dead-layer removal: 32 layers
[11/01/2024-10:32:48] [V] [TRT] Running: ConstShuffleFusion on classifier.1.bias
[11/01/2024-10:32:48] [V] [TRT] ConstShuffleFusion: Fusing classifier.1.bias with ONNXTRT_Broadcast
[11/01/2024-10:32:48] [V] [TRT] After Myelin optimization: 15 layers
[11/01/2024-10:32:48] [V] [TRT] Running: ConvReluFusion on /features/features.0/Conv
[11/01/2024-10:32:48] [V] [TRT] ConvReluFusion: Fusing /features/features.0/Conv with /features/features.1/Relu
[11/01/2024-10:32:48] [V] [TRT] Running: PoolingErasure on /avgpool/AveragePool
[11/01/2024-10:32:48] [V] [TRT] Removing /avgpool/AveragePool
[11/01/2024-10:32:48] [V] [TRT] After concat removal: 9 layers
[V] [TRT] =============== Computing costs for /features/features.0/Conv + /features/features.1/Relu
[V] [TRT] *************** Autotuning format combination: Float(150528,50176,224,1) -> Float(193600,3025,55,1) ***************
[V] [TRT] --------------- Timing Runner: /features/features.0/Conv + /features/features.1/Relu (CaskConvolution[0x80000009])
[V] [TRT] Tactic Name: ampere_scudnn_128x64_relu_xregs_large_nn_v1 Tactic: 0x5deb29b7a8e275f7 Time: 0.0521752
[V] [TRT] Tactic Name: ampere_scudnn_128x32_relu_small_nn_v1 Tactic: 0xd828f024626fa982 Time: 0.0513463
[V] [TRT] /features/features.0/Conv + /features/features.1/Relu (CaskConvolution[0x80000009]) profiling completed in 0.0813502 seconds. Fastest Tactic: 0xd828f024626fa982 Time: 0.0513463
[V] [TRT] Skipping CaskFlattenConvolution: No valid tactics for /features/features.0/Conv + /features/features.1/Relu
[V] [TRT] >>>>>>>>>>>>>>> Chose Runner Type: CaskConvolution Tactic: 0xd828f024626fa982
[04/11/2025-15:15:52] [I] === Performance summary ===
[04/11/2025-15:15:52] [I] Throughput: 32.7494 qps
[04/11/2025-15:15:52] [I] Latency: min = 0.250122 ms, max = 1.62878 ms, mean = 0.2559 ms, median = 0.255371 ms
[04/11/2025-15:15:52] [I] Total Host Walltime: 3.00047 s
[04/11/2025-15:15:52] [W] * GPU compute time is unstable, with coefficient of variance = 7.41713%.
[04/11/2025-15:15:52] [W]   If not already in use, locking GPU clock frequency or adding --useSpinWait may improve the stability.
[04/11/2025-15:15:52] [I] Explanations of the performance metrics are printed in the verbose logs.
[04/11/2025-15:15:52] [V]
[04/11/2025-15:15:52] [V] === Explanations of the performance metrics ===
[04/11/2025-15:15:52] [V] Total Host Walltime: the host walltime from when the first query is enqueued.
&&&& PASSED TensorRT.trtexec [TensorRT v100700] # trtexec --onnx=alexnet.onnx --verbose
"""


def test_trt10_snippet():
    log = parse_build_log(TRT10, "trt10.log")
    assert log.tool_version == "TensorRT 10.7.0"
    assert log.layer_trajectory == (("Original", 32), ("After dead-layer removal", 32),
                                    ("After Myelin optimization", 15), ("After concat removal", 9))
    assert log.pass_counts == {"ConstShuffleFusion": 1, "ConvReluFusion": 1, "PoolingErasure": 1}
    assert [e.kind for e in log.events if e.pass_name == "PoolingErasure"] == ["running", "removing"]
    layer = "/features/features.0/Conv + /features/features.1/Relu"
    assert log.timings == ((f"{layer} (CaskConvolution[0x80000009])", "ampere_scudnn_128x64_relu_xregs_large_nn_v1",
                            0.0521752),
                           (f"{layer} (CaskConvolution[0x80000009])", "ampere_scudnn_128x32_relu_small_nn_v1",
                            0.0513463))
    assert log.tactic_choices == (TacticChoice(layer, "CaskConvolution", "0xd828f024626fa982", 0.0513463),)
    assert log.performance == {"Throughput": "32.7494 qps", "Total Host Walltime": "3.00047 s",
                               "Latency": "min = 0.250122 ms, max = 1.62878 ms, mean = 0.2559 ms, median = 0.255371 ms"}
    assert any("coefficient of variance = 7.41713%" in n and "useSpinWait" in n for n in log.notes)


def test_trt7_python_logger_and_version_8601():
    text = ("[TensorRT] VERBOSE: Original: 8 layers\n"
            "[TensorRT] VERBOSE: BinaryFusion: Fusing vgg0_conv10_fwd with vgg0_relu10_fwd\n"
            "[TensorRT] VERBOSE: --------------- Timing Runner: (Unnamed Layer* 0) [Convolution] (FusedConvActConvolution)\n"
            "[TensorRT] VERBOSE: Tactic: 1002 time 0.059008\n"
            "[TensorRT] VERBOSE: Fastest Tactic: 1002 Time: 0.059008\n"
            "[TensorRT] VERBOSE: >>>>>>>>>>>>>>> Chose Runner Type: FusedConvActConvolution Tactic: 1002\n"
            "&&&& PASSED TensorRT.trtexec [TensorRT v8601] # trtexec --onnx=lstm.onnx --verbose\n")
    log = parse_build_log(text)
    assert log.tool_version == "TensorRT 8.6.1"
    assert log.pass_counts == {"BinaryFusion": 1}       # fusions count when no "Running:" line names the pass
    assert log.timings == (("(Unnamed Layer* 0) [Convolution] (FusedConvActConvolution)", "1002", 0.059008),)
    assert log.tactic_choices == (TacticChoice("(Unnamed Layer* 0) [Convolution]", "FusedConvActConvolution",
                                               "1002", 0.059008),)


def test_strip_prefix_forms():
    assert strip_prefix("[01/10/2024-21:52:52] [V] [TRT] Original: 755 layers") == ("Original: 755 layers", True)
    assert strip_prefix("01/10/2024-21:52:50] [I] === Model Options ===") == ("=== Model Options ===", True)
    assert strip_prefix("[11/22/2026-10:00:00] [V] [kiln] Removing x") == ("Removing x", True)
    assert strip_prefix("[W] [TRT] careful") == ("careful", True)
    assert strip_prefix("[TensorRT] INFO: hello") == ("hello", True)
    assert strip_prefix("Layer(Reformat): a, Tactic: 0x0") == ("Layer(Reformat): a, Tactic: 0x0", False)


def test_log_without_pass_lines_gets_a_note():
    log = parse_build_log("[03/16/2024-13:35:03] [I] === Performance summary ===\n"
                          "[03/16/2024-13:35:03] [I] Throughput: 4300.33 qps\n")
    assert log.performance == {"Throughput": "4300.33 qps"}
    assert "log contains no pass lines; was it built with --verbose?" in log.notes


@pytest.mark.parametrize("text", ["", "   \n\n", b"\x00\x01\x02\xff\xfe" * 200, "\x00" * 50,
                                  "just some words\nnothing like a log\n"])
def test_bad_input_raises_artifact_error(text):
    with pytest.raises(ArtifactError) as err:
        parse_build_log(text, "broken.log")
    assert "broken.log" in str(err.value) and "hint" in str(err.value)


def test_non_ascii_and_garbled_lines_do_not_stop_the_parse():
    text = ("[01/10/2024-21:52:53] [V] [TRT]去除双重层后:153层\n"
            "[01/10/2024-21:52:53] [V] [TRT] Tactic: 0xzz Time: 1.2.3\n"
            "\ufeff[01/10/2024-21:52:53] [V] [TRT] Running: ConvReluFusion on c\n"
            "[01/10/2024-21:52:53] [V] [TRT] Running: ConvReluFusion on d\n")
    log = parse_build_log(text)
    assert log.pass_counts == {"ConvReluFusion": 2}
    assert any("non-ASCII" in n for n in log.notes)


def _tiny_model():
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.random((4, 3, 3, 3), dtype=np.float32), "w1")
    w2 = numpy_helper.from_array(rng.random((4, 4, 3, 3), dtype=np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2")]
    value = helper.make_tensor_value_info
    return make_model(nodes, [value("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [value("y", TensorProto.FLOAT, [1, 4, 8, 8]), value("c2", TensorProto.FLOAT, [1, 4, 8, 8])],
                      [w1, w2])


@pytest.fixture(scope="module")
def kiln_log_text():
    import kiln

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("[11/22/2026-10:00:00] [V] [kiln] %(message)s"))
    logger = logging.getLogger("kiln.build")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        kiln.build(_tiny_model())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return buf.getvalue()


def test_kiln_build_log(kiln_log_text):
    log = parse_build_log(kiln_log_text, "kiln-build.log")
    assert log.pass_counts["ConvReluFusion"] == 2
    fusing = [e for e in log.events if e.kind == "fusing"]
    assert [(e.pass_name, e.subjects) for e in fusing] == [("ConvReluFusion", ("conv1", "relu1"))]
    not_fused = [e for e in log.events if e.kind == "not_fused"]
    assert len(not_fused) == 1
    assert not_fused[0].pass_name == "ConvReluFusion"
    assert not_fused[0].subjects == ("conv2", "relu2", "conv2's output 'c2' is a network output")
    assert log.layer_trajectory[0] == ("Original", 4)
    assert ("After vertical fusions", 3) in log.layer_trajectory
    chosen = {c.layer for c in log.tactic_choices}
    assert {"conv1 + relu1", "conv2", "relu2"} <= chosen
    assert all(c.time_ms is not None and c.tactic.startswith("0x") for c in log.tactic_choices)
    assert {t[1] for t in log.timings} >= {"torch.reference", "onnxruntime.layer"}
    assert "Total Activation Memory" in log.memory and "Total Weights Memory" in log.memory
    assert any("'Layer(...)' line(s)" in n for n in log.notes)
    dumped = [line for line in kiln_log_text.splitlines() if "[kiln] Layer(" in line]   # kiln's own tag
    assert log.engine is not None and len(log.engine.layers) == len(dumped) >= 1
    assert [l.name for l in log.engine.layers] == [d.split("): ", 1)[1].split(", Tactic: ")[0] for d in dumped]
    assert all(l.outputs and l.outputs[0].precision == "FP32" and l.tactic_value.startswith("0x")
               for l in log.engine.layers)
