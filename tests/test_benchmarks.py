"""benchmarks/: compare.py's timing schedule (blocks rotate so no engine always follows the same neighbour, each
opening with an untimed inference that absorbs the previous engine's spinning threads), the CPU line every
benchmark prints first, and the runs CSV compare.py appends to; no real benchmark runs here."""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare  # noqa: E402
import cpu_info  # noqa: E402
import record  # noqa: E402


def test_blocks_rotate_and_open_with_an_untimed_inference():
    calls = []
    runners = {k: (lambda k=k: calls.append(k)) for k in ("kiln", "onnxruntime", "openvino")}
    samples = compare.time_blocks(runners, rounds=4, runs=2)
    warmup, timed = calls[:3 * compare.WARMUP], calls[3 * compare.WARMUP:]
    assert warmup == [k for k in runners for _ in range(compare.WARMUP)]
    blocks = [timed[i:i + 3] for i in range(0, len(timed), 3)]   # one untimed + two timed calls per block
    assert all(len(set(b)) == 1 for b in blocks)
    order = [b[0] for b in blocks]
    assert order == ["kiln", "onnxruntime", "openvino", "onnxruntime", "openvino", "kiln",
                     "openvino", "kiln", "onnxruntime", "kiln", "onnxruntime", "openvino"]
    assert {k: len(v) for k, v in samples.items()} == {k: 4 * 2 for k in runners}


LSCPU = """Architecture:                            x86_64
Model name:                              Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
Flags:                                   fpu sse2 avx2 avx512f avx512_bf16 avx512_fp16 avx512_vnni amx_bf16 amx_tile
"""
PROC_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 fma avx2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 fma avx2
"""


def test_cpu_line_names_the_model_and_every_isa_flag_present_or_absent():
    assert cpu_info.cpu_line(LSCPU) == (
        "CPU: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz; avx2 yes, avx512f yes, avx512_bf16 yes, "
        "avx512_fp16 yes, avx512_vnni yes, avx_vnni no, amx_bf16 yes, amx_int8 no")
    assert cpu_info.cpu_line(PROC_CPUINFO) == (   # /proc/cpuinfo's spelling, where lscpu is missing
        "CPU: AMD EPYC 7B13; avx2 yes, avx512f no, avx512_bf16 no, avx512_fp16 no, avx512_vnni no, avx_vnni no, "
        "amx_bf16 no, amx_int8 no")
    assert cpu_info.cpu_line("") == "CPU: unknown CPU; " + ", ".join(f"{f} no" for f in cpu_info.ISA_FLAGS)


def fake_result(name: str, medians: dict[str, float]) -> dict:
    return {"name": name, "medians": medians, "build_s": 9.25, "load_s": 0.125, "bound_ms": 8.0,
            "plan": compare.plan_summary(["Convolution", "Reformat", "Convolution"])}


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == record.COLUMNS
        return list(reader)


def test_run_rows_append_to_the_csv_with_one_header(tmp_path):
    path = tmp_path / "results" / "runs.csv"
    first = compare.run_rows([fake_result("resnet18", {"kiln": 10.0, "onnxruntime": 12.5, "openvino": 11.0,
                                                       "torch eager": 20.0})],
                             "2026-11-24T09:30Z", LSCPU, 2, "abc1234-dirty", "after the GEMM change")
    record.append_rows(first, path)
    second = compare.run_rows([fake_result("resnet18-int8", {"kiln": 5.0, "kiln fp32": 9.5, "onnxruntime": 4.0})],
                              "B2", PROC_CPUINFO, 4, "", "")
    record.append_rows(second, path)
    assert path.read_text().count("run,date,cpu") == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["runs.csv"]   # no temp file left behind
    rows = read_rows(path)
    assert rows[0] == {
        "run": "2026-11-24T09:30Z", "date": "2026-11-24", "cpu": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
        "isa": "avx2 avx512f avx512_bf16 avx512_fp16 avx512_vnni amx_bf16", "threads": "2", "model": "resnet18",
        "kiln_ms": "10", "onnxruntime_ms": "12.5", "openvino_ms": "11", "openvino_default_ms": "", "torch_ms": "20",
        "kiln_over_ort": "0.8",
        "kiln_over_best": "0.9091", "kiln_over_bound": "1.25", "build_s": "9.25", "load_s": "0.125",
        "plan": "3 layers: 2 Convolution, 1 Reformat", "commit": "abc1234-dirty", "notes": "after the GEMM change"}
    assert (rows[1]["run"], rows[1]["cpu"], rows[1]["isa"], rows[1]["threads"]) == ("B2", "AMD EPYC 7B13", "avx2", "4")
    assert (rows[1]["openvino_ms"], rows[1]["torch_ms"]) == ("", "")          # not measured: empty, not 0
    assert (rows[1]["kiln_over_ort"], rows[1]["kiln_over_best"]) == ("1.25", "1.25")   # kiln's FP32 is no peer
    assert rows[1]["notes"] == "kiln FP32 engine 9.50 ms"


def test_a_csv_with_another_header_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("model,kiln\nresnet18,1.0\n")
    rows = compare.run_rows([fake_result("resnet18", {"kiln": 1.0, "onnxruntime": 1.0})], "X", "", 2, "", "")
    with pytest.raises(SystemExit, match=r"runs\.csv: header 'model,kiln' is not 'run,date,cpu,"):
        record.append_rows(rows, path)
    assert path.read_text() == "model,kiln\nresnet18,1.0\n"


def test_compare_prints_the_cpu_first_and_records_unless_told_not_to(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "lscpu_text", lambda: LSCPU)
    monkeypatch.setattr(compare, "peak_gflops", lambda threads: 100.0)
    monkeypatch.setattr(compare, "bench", lambda name, workdir, args: fake_result(
        name, {"kiln": 10.0, "onnxruntime": 12.5, "openvino": 11.0, "torch eager": 20.0}))
    path = tmp_path / "runs.csv"
    assert compare.main(["--models", "resnet18,resnet50", "--results-csv", str(path), "--run-id", "T1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == cpu_info.cpu_line(LSCPU)
    assert out[-1] == f"recorded run T1 (2 row(s)) in {path}"
    assert [(r["run"], r["model"]) for r in read_rows(path)] == [("T1", "resnet18"), ("T1", "resnet50")]
    assert compare.main(["--models", "resnet18", "--results-csv", str(path), "--no-record"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("CPU: Intel(R) Xeon(R)")
    assert len(read_rows(path)) == 2


def test_the_recorded_history_is_well_formed():
    rows = read_rows(record.RUNS_CSV)
    assert len(rows) >= 83 and all(r["run"] and r["date"] and r["cpu"] and r["model"] for r in rows)
    for r in rows:   # every stored ratio agrees with its stored medians (to the 3 decimals runs were written with)
        if r["kiln_ms"] and r["onnxruntime_ms"]:
            assert abs(float(r["kiln_ms"]) / float(r["onnxruntime_ms"]) - float(r["kiln_over_ort"])) < 1.5e-3, r
        if r["kiln_ms"] and r["onnxruntime_ms"] and r["openvino_ms"]:
            peers = [float(r[k]) for k in ("onnxruntime_ms", "openvino_ms", "openvino_default_ms", "torch_ms") if r[k]]
            assert abs(float(r["kiln_ms"]) / min(peers) - float(r["kiln_over_best"])) < 1.5e-3, r


def test_longrun_prints_the_cpu_line_first(monkeypatch, capsys):
    import longrun

    monkeypatch.setattr(longrun, "cpu_line", lambda: "CPU: test")
    assert longrun.main(["--runs", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "CPU: test"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_bench_runs_kiln_and_its_peers_on_a_real_model(tmp_path, monkeypatch, precision):
    """The real `bench` (build, save, load, peers, blocks, plan summary) on a tiny CNN, one round of one run: the
    code path the benchmark takes, so a stale attribute cannot hide until the next benchmark run. With bf16,
    OpenVINO's default precision joins and cosines to onnxruntime's FP32 output are reported."""
    import argparse

    import torch

    from tests.models.nets import export

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "tiny.onnx"
    export(model, x, path)
    if precision == "int8":   # a Q/DQ export beside its FP32 network, as build_model makes them
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.batches = iter([{"input": torch.randn(1, 3, 16, 16).numpy()} for _ in range(2)])

            def get_next(self):
                return next(self.batches, None)
        quantize_static(str(path), str(tmp_path / "tiny_qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True)
    model_path = tmp_path / "tiny_qdq.onnx" if precision == "int8" else path
    exporters = []
    monkeypatch.setattr(compare, "build_model", lambda name, workdir, exporter, dynamic: (
        exporters.append((exporter, dynamic)), model, {"input": x.numpy()}, model_path)[1:])
    args = argparse.Namespace(threads=1, compile=False, rounds=1, runs=1, peak_gflops=100.0, precision=precision,
                              exporter="dynamo", dynamic=False)
    result = compare.bench("tiny", tmp_path, args)
    assert exporters == [("dynamo", False)]   # --exporter and --dynamic reach the export
    peers = {"onnxruntime"} if precision == "int8" else {"onnxruntime", "torch eager"}   # torch runs FP32 only
    assert result["name"] == "tiny" and {"kiln"} | peers <= set(result["medians"])
    if precision != "fp32":   # kiln's own kernels beside kiln with every source; cosines to the FP32 network
        assert "kiln own" in result["medians"] and result["cosines"]["kiln own"] > 0.99
    if precision == "int8":
        assert "kiln fp32" in result["medians"] and result["cosines"]["kiln"] > 0.99
        rows = compare.run_rows([result], "2026-11-24T09:30Z", LSCPU, 1, "abc1234", "")
        assert re.search(r"kiln own kernels only [\d.]+ ms; kiln INT8; cosine to FP32: kiln 0\.99", rows[0].notes), \
            rows[0].notes
    if precision == "bf16":
        assert ("openvino default" in result["medians"]) == ("openvino" in result["medians"])
        assert result["cosines"]["kiln"] > 0.999
        rows = compare.run_rows([result], "2026-11-24T09:30Z", LSCPU, 1, "abc1234", "")
        assert re.search(r"cosine to FP32: kiln (0\.99\d{4}|1\.000000)", rows[0].notes), rows[0].notes
        assert rows[0].openvino_default_ms == result["medians"].get("openvino default", "")
    assert re.fullmatch(r"\d+ layers?: \d+ \w+(, \d+ \w+)*", result["plan"]), result["plan"]
    assert result["bound_ms"] > 0 and result["build_s"] > 0


def test_overhead_prints_the_cpu_first_then_every_tactic_of_the_tiny_layers(capsys):
    import overhead

    assert overhead.main(["--calls", "3", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    rows = [line.split() for line in lines[2:]]
    tactics = {row[-2] for row in rows}
    assert {"torch.reference", "onednn.linear_prepacked"} <= tactics
    assert all(float(row[-1]) > 0 for row in rows)


def test_overhead_times_a_bf16_tactic_as_a_bf16_plan_feeds_it():
    """The `bf16 io` rows: a BF16 tactic's activation and output as bfloat16 (its weights as they were); an FP32
    tactic gets no such row."""
    import overhead

    from kiln.tactics.registry import TACTICS_BY_NAME

    conv = dict(overhead.tiny_layers())["conv 1x1 8ch 4x4"]
    stored = overhead.stored_bf16(conv, TACTICS_BY_NAME["onednn.conv2d_primitive_bf16"])
    assert stored.input_dtypes == ("bfloat16", "float32", "float32") and stored.output_dtypes == ("bfloat16",)
    assert stored.const_inputs is conv.const_inputs
    assert overhead.stored_bf16(conv, TACTICS_BY_NAME["onednn.conv2d_primitive"]) is None


def test_serve_load_smoke(tmp_path, capsys):
    """benchmarks/serve_load.py end to end on the serving tests' tiny conv net: a real `kiln serve` per setting,
    tritonclient.grpc.aio clients, every response checked against Engine.run (one setting: each costs a server
    start)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("tritonclient.grpc.aio")
    import serve_load

    results = serve_load.main(["--models", "tiny", "--clients", "2", "--seconds", "1", "--warmup-seconds", "0.2",
                               "--batch-sizes", "4", "--workdir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ")
    assert [(r.model, r.max_batch_size, r.clients) for r in results] == [("conv", 4, 2)]
    for r in results:
        assert r.requests > 0 and r.qps > 0 and 0 < r.p50_ms <= r.p99_ms
        assert (r.errors, r.mismatches) == (0, 0)
        assert r.rss_start_mib > 50 and r.rss_end_mib > 50   # a Python server with torch loaded: tens of MiB at least


def test_the_qat_model_has_qdq_only_before_products_and_its_fp32_network_beside_it(tmp_path):
    """`resnet18-qat`: TensorRT-style QAT (symmetric INT8, a Q/DQ pair on each convolution's and the classifier's
    input and weights), the FP32 export beside it under the name compare.py
    derives; an unknown suffix names what exists."""
    from collections import Counter

    import onnx

    import bench_models

    _, feeds, path = bench_models.build_model("resnet18-qat", tmp_path)
    assert path.name == "resnet18-qat_qat.onnx" and (tmp_path / "resnet18-qat.onnx").exists()
    graph = onnx.load(path).graph
    ops = Counter(n.op_type for n in graph.node)
    # each input and each weight (FP32, as pytorch-quantization exports it) through its own Q/DQ pair
    assert (ops["Conv"], ops["Gemm"], ops["QuantizeLinear"], ops["DequantizeLinear"]) == (20, 1, 42, 42)
    assert feeds["input"].shape == (1, 3, 224, 224)
    producers = {o: n for n in graph.node for o in n.output}
    constants = {**{t.name: t for t in graph.initializer},   # the legacy exporter writes them as Constant nodes
                 **{n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant"}}
    for node in (n for n in graph.node if n.op_type in ("Conv", "Gemm")):
        dequantize = producers[node.input[0]]
        assert dequantize.op_type == "DequantizeLinear"
        zero_point = constants[dequantize.input[2]]
        assert zero_point.data_type == onnx.TensorProto.INT8   # symmetric, signed
        assert not onnx.numpy_helper.to_array(zero_point).any()
    with pytest.raises(SystemExit, match="-qdq after bert-base or minilm"):
        bench_models.build_model("resnet18-qdq", tmp_path)


def test_a_dynamic_export_has_a_symbolic_batch_and_kiln_a_profile_around_the_feeds(tmp_path):
    """--dynamic: the export's batch axis is symbolic, as deployment exports have it; kiln is built with a profile
    from 1 to 4x the feeds' batch, opt at the feeds, where its compute bound is counted (ResNet-18: 3.6 GFLOP)."""
    import onnx

    import bench_models
    import kiln

    _, feeds, path = bench_models.build_model("resnet18", tmp_path, "legacy", dynamic=True)
    batch = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param == "batch" and feeds["input"].shape == (1, 3, 224, 224)
    shapes = compare.profile_around(path, feeds)
    assert shapes == {"min_shapes": "input:1x3x224x224", "opt_shapes": "input:1x3x224x224",
                      "max_shapes": "input:4x3x224x224"}
    engine = kiln.build(str(path), autotune=False, **shapes)
    assert engine.plan.inputs[0].dynamic == (0,) and compare.flops(engine.plan) == pytest.approx(3.63e9, rel=0.01)
    x = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
    assert engine.run({"input": x})["output"].shape == (3, 1000)
    with pytest.raises(SystemExit, match="--dynamic takes resnet18 and resnet50"):
        bench_models.build_model("yolov8n", tmp_path, "legacy", dynamic=True)
