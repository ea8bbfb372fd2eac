"""kiln against its peers on CPU, batch 1, in one process: onnxruntime, OpenVINO (if installed), torch eager
and torch.compile (with --compile; its first call takes minutes).

    make bench                                     # = .venv/bin/python benchmarks/compare.py
    .venv/bin/python benchmarks/compare.py --models resnet18,resnet50,bert-base,yolov8n --runs 10 --rounds 10

Networks are built from torch code (tests/models/: ResNet-18/50 at 224x224, a BERT-base-shaped HF BertModel at
seq 128, a YOLOv8n-shaped detector at 640x640; random weights, randomized BatchNorm statistics) and exported with
the legacy exporter (--exporter dynamo: torch.export's; --dynamic: batch and sequence axes symbolic, as deployment
exports have them, kiln's build given a profile around the feeds' shapes) to a temporary folder. Every engine gets
5 warm-up runs; then timed blocks of --runs inferences rotate through the engines --rounds times (the order
shifting by one engine per round, an untimed inference opening each block), so drift hits all alike; medians are
over all timed runs.
Reported: median ms per engine, kiln's ratio to onnxruntime and to the best peer, kiln's build time
(cold timing cache) and load time, and kiln's ratio to the compute lower bound (FLOPs / the best fp32 throughput
measured at start-up on this machine with the same threads: a 1024^3 matrix product or a 3x3 oneDNN convolution).

OpenVINO is pinned to FP32 arithmetic (INFERENCE_PRECISION_HINT=f32): on CPUs with AVX512-BF16 or AMX its default
is bf16, about 2x faster and not an FP32 peer. torch eager runs the FP32 network, so it is no peer on INT8 models.
--precision int8 quantizes the ResNets with quantize_static (Q/DQ) and the encoders with quantize_dynamic; name a
ResNet `resnet50-int8dyn` for quantize_dynamic (s8 weights, ConvInteger) or `resnet50-qat` for a TensorRT-style QAT
export, an encoder `bert-base-qdq` for quantize_static (bench_models.py says how each is made).

The first line printed names the CPU and its ISA extensions (cpu_info.py). At the end the run's rows are appended to
benchmarks/results/runs.csv (record.py; --no-record skips it, --results-csv writes elsewhere).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_models import QUANTIZED, build_model  # noqa: E402
from cpu_info import cpu_line, lscpu_text, parse_cpu, present_isa  # noqa: E402  (benchmarks/, the script's folder)
from record import RUNS_CSV, RunRow, append_rows, git_commit  # noqa: E402

from kiln import optional  # noqa: E402
from kiln.errors import MissingDependencyError  # noqa: E402

WARMUP = 5


def flops(plan) -> float:
    """Multiply-adds x2 of convolutions, matrix products and attention in a kiln plan (regions included), at the
    shapes its layers record (a dynamic plan's: its profile's opt point)."""
    total = 0.0
    for layer in [i for l in plan.layers for i in (l.inner or (l,))]:
        out = layer.outputs[0].dims if layer.outputs else ()
        if layer.op_type in ("Conv", "QConv", "DynamicQConv"):
            w = plan.weights[layer.args[1].name].shape
            total += 2 * np.prod(out) * np.prod(w[1:])
        elif layer.op_type in ("Gemm", "MatMul", "QGemm", "QMatMul", "DynamicQMatMul") and \
                layer.args[1].kind == "weight":
            k = plan.weights[layer.args[1].name].shape
            total += 2 * np.prod(out) * (k[1] if layer.attrs.get("transB") else k[0])
        elif layer.op_type == "Attention" and len(out) == 3:   # Q·Kᵀ and P·V over [batch, seq, hidden]
            total += 4 * out[0] * out[1] * out[1] * out[2]
    return float(total)


def peers(onnx_path: str, model, feeds: dict[str, np.ndarray], threads: int, with_compile: bool,
          precision: str = "fp32"):
    """name -> zero-argument callable running one inference. With precision bf16, OpenVINO also runs at its
    default inference precision ("openvino default": bf16 on CPUs with AVX512-BF16 or AMX)."""
    import onnxruntime as ort
    import torch

    out = {}
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    out["onnxruntime"] = lambda: sess.run(None, feeds)
    try:
        ov = optional.require("openvino", "OpenVINO's rows")   # as kiln imports it: its telemetry declined
        compiled = ov.Core().compile_model(onnx_path, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                              "INFERENCE_PRECISION_HINT": "f32"})
        request = compiled.create_infer_request()
        out["openvino"] = lambda: request.infer(feeds)
        if precision == "bf16":
            default = ov.Core().compile_model(onnx_path, "CPU", {"INFERENCE_NUM_THREADS": threads})
            default_request = default.create_infer_request()
            out["openvino default"] = lambda: default_request.infer(feeds)
    except MissingDependencyError:
        pass
    except RuntimeError as e:   # OpenVINO 2026.4 fails on quantize_static BERT's Q/DQ attention scale, for one
        last = next((line for line in reversed(str(e).splitlines()) if line.strip()), type(e).__name__)
        empty = "openvino default" if "openvino" in out else "openvino"
        print(f"{Path(onnx_path).name}: OpenVINO cannot compile it ('{empty}' left empty): ...{last[-160:]}",
              flush=True)
    args = [torch.from_numpy(feeds[i.name]) for i in sess.get_inputs()]
    if Path(onnx_path).stem.endswith(QUANTIZED):
        return out   # torch runs the FP32 network: not a peer on the quantized model
    out["torch eager"] = lambda: model(*args)
    if with_compile:
        compiled_model = torch.compile(model)
        out["torch.compile"] = lambda: compiled_model(*args)
    return out


def peak_gflops(threads: int) -> float:
    """The best fp32 throughput measured here: a 1024^3 matrix product, and a 3x3 256-channel convolution on
    14x14 through oneDNN with prepacked weights (on AVX-512 machines the convolution runs closer to the peak)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x = torch.randn(1, 256, 14, 14).contiguous(memory_format=torch.channels_last)
    w = torch.ops.mkldnn._reorder_convolution_weight(torch.randn(256, 256, 3, 3), [1, 1], [1, 1], [1, 1], 1,
                                                     [1, 256, 14, 14])
    conv = torch.ops.mkldnn._convolution_pointwise
    work = {2 * 1024 ** 3: lambda: a @ b,
            2 * 256 * 256 * 9 * 14 * 14: lambda: conv(x, w, None, [1, 1], [1, 1], [1, 1], 1, "none", [], None)}
    best = 0.0
    with torch.inference_mode():
        for flop, fn in work.items():
            for _ in range(5):
                fn()
            times = []
            for _ in range(30):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best = max(best, flop / min(times) / 1e9)
    return best


def time_blocks(runners: dict, rounds: int, runs: int) -> dict[str, list[float]]:
    """Per engine, the ms of every timed run. Each round times a block of `runs` inferences per engine, the
    order rotating by one engine per round so none always follows the same neighbour; each block starts with
    one untimed inference, which pays for the previous engine's threads still spinning on the cores
    (onnxruntime's first inference after its own block took 2x its steady time here)."""
    import torch

    names = list(runners)
    samples: dict[str, list[float]] = {k: [] for k in names}
    with torch.inference_mode():
        for fn in runners.values():
            for _ in range(WARMUP):
                fn()
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                fn = runners[k]
                fn()
                for _ in range(runs):
                    t = time.perf_counter()
                    fn()
                    samples[k].append((time.perf_counter() - t) * 1e3)
    return samples


def bench(name: str, workdir: Path, args) -> dict:
    import torch

    import kiln
    from kiln.trt.vocab import layer_type

    torch.set_num_threads(args.threads)
    model, feeds, path = build_model(name, workdir, args.exporter, args.dynamic)
    shapes = profile_around(path, feeds) if args.dynamic else {}
    t0 = time.perf_counter()
    engine = kiln.build(str(path), bf16=args.precision == "bf16", **shapes)
    build_s = time.perf_counter() - t0
    engine.save(workdir / f"{name}.kiln")
    t0 = time.perf_counter()
    engine = kiln.load(workdir / f"{name}.kiln")
    engine.kernels   # load = read + verify + prepare every kernel
    load_s = time.perf_counter() - t0
    ctx = engine.create_execution_context()
    runners = {"kiln": lambda: ctx.execute(feeds),
               **peers(str(path), model, feeds, args.threads, args.compile, args.precision)}
    fp32_path = path.with_stem(next((path.stem.removesuffix(q) for q in QUANTIZED if path.stem.endswith(q)), path.stem))
    if args.precision != "fp32":   # kiln's own kernels only: no OpenVINO or onnxruntime region
        own = kiln.build(str(path), bf16=args.precision == "bf16", tactic_sources="-openvino,-onnxruntime",
                         **shapes).create_execution_context()
        runners["kiln own"] = lambda: own.execute(feeds)
    cosines = cosines_to_fp32(runners, fp32_reference(fp32_path, feeds, args.threads)) \
        if args.precision != "fp32" else {}
    if path.stem.endswith(QUANTIZED):   # INT8 vs kiln's own FP32 engine of the same network
        fp32 = kiln.build(str(fp32_path), **shapes).create_execution_context()
        runners["kiln fp32"] = lambda: fp32.execute(feeds)
    samples = time_blocks(runners, args.rounds, args.runs)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    bound_ms = flops(engine.plan) / (args.peak_gflops * 1e9) * 1e3
    return {"name": name, "medians": medians, "build_s": build_s, "load_s": load_s, "bound_ms": bound_ms,
            "plan": plan_summary([layer_type(l) for l in engine.plan.layers]), "cosines": cosines,
            "bf16_layers": sum(i.precision == "BF16" for l in engine.plan.layers for i in (l.inner or (l,)))}


def profile_around(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, str]:
    """kiln.build's min/opt/max shapes for a model with symbolic axes: opt the feeds' shapes, min 1 and max 4x
    opt in each symbolic axis (batch 1-4, sequence 1-512 around 128)."""
    import onnx

    symbolic = {i.name: [bool(d.dim_param) or not d.dim_value for d in i.type.tensor_type.shape.dim]
                for i in onnx.load(str(path), load_external_data=False).graph.input}

    def spec(scale) -> str:
        return ",".join(f"{n}:" + "x".join(str(scale(d) if s else d) for d, s in zip(feeds[n].shape, symbolic[n]))
                        for n in feeds)
    return {"min_shapes": spec(lambda d: 1), "opt_shapes": spec(lambda d: d), "max_shapes": spec(lambda d: 4 * d)}


def fp32_reference(fp32_path: Path, feeds: dict[str, np.ndarray], threads: int) -> np.ndarray:
    """onnxruntime's FP32 output (first output) of the FP32 network: the reference every reduced engine is scored
    against (for a Q/DQ model, the network before quantization)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return np.asarray(ort.InferenceSession(str(fp32_path), so, providers=["CPUExecutionProvider"])
                      .run(None, feeds)[0], dtype=np.float64).ravel()


def cosines_to_fp32(runners: dict, want: np.ndarray) -> dict[str, float]:
    """Cosine of every engine's first output to the FP32 reference."""
    def first(result) -> np.ndarray:
        if hasattr(result, "values"):   # kiln's dict, OpenVINO's OVDict
            result = next(iter(result.values()))
        elif isinstance(result, (list, tuple)):
            result = result[0]
        return np.asarray(result, dtype=np.float64).ravel()

    out = {}
    for name, fn in runners.items():
        if name in ("kiln fp32", "torch eager", "torch.compile"):
            continue
        got = first(fn())
        out[name] = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    return out


def plan_summary(layer_types: list[str]) -> str:
    """'3 layers: 2 Convolution, 1 Reformat': the runners of kiln's plan, most frequent first (a whole-graph
    region is one layer of type OpenVINO or OnnxRuntime)."""
    counts = Counter(layer_types).most_common()
    return f"{len(layer_types)} layer{'s' if len(layer_types) != 1 else ''}: " + \
        ", ".join(f"{n} {t}" for t, n in counts)


def run_rows(results: list[dict], run: str, cpu_text: str, threads: int, commit: str, note: str) -> list[RunRow]:
    """One runs.csv row per benchmarked model of this run."""
    model, flags = parse_cpu(cpu_text)
    date = run[:10] if run[:4].isdigit() else datetime.now(timezone.utc).strftime("%Y-%m-%d")
    rows = []
    for r in results:
        m = r["medians"]
        best = min(v for k, v in m.items() if not k.startswith("kiln"))
        notes = [note] if note else []
        if "kiln fp32" in m:
            notes.append(f"kiln FP32 engine {m['kiln fp32']:.2f} ms")
        if "kiln own" in m:
            notes.append(f"kiln own kernels only {m['kiln own']:.2f} ms")
        if r.get("cosines"):   # a --precision bf16|int8 run
            kind = f"--bf16 ({r['bf16_layers']} BF16 layers)" if r["bf16_layers"] else "INT8"
            notes.append(f"kiln {kind}; cosine to FP32: " +
                         ", ".join(f"{k} {v:.6f}" for k, v in r["cosines"].items()))
        rows.append(RunRow(run, date, model, " ".join(present_isa(flags)), threads, r["name"], m["kiln"],
                           m.get("onnxruntime", ""), m.get("openvino", ""), m.get("openvino default", ""),
                           m.get("torch eager", ""),
                           m["kiln"] / m["onnxruntime"], m["kiln"] / best, m["kiln"] / max(r["bound_ms"], 1e-9),
                           r["build_s"], r["load_s"], r["plan"], commit, "; ".join(notes)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--runs", type=int, default=10, help="timed inferences per engine per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow first call)")
    p.add_argument("--precision", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="bf16: kiln built with --bf16 beside OpenVINO's default and f32, onnxruntime FP32; cosines to "
                        "onnxruntime's FP32 outputs printed")
    p.add_argument("--exporter", choices=["legacy", "dynamo"], default="legacy",
                   help="how the networks are exported: torch.onnx's TorchScript exporter at opset 17 (default) or "
                        "torch.export's (dynamo=True) at torch's default opset")
    p.add_argument("--dynamic", action="store_true",
                   help="export with symbolic batch (and sequence) axes; kiln builds a profile around the feeds")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the results CSV")
    p.add_argument("--results-csv", type=Path, default=RUNS_CSV, help=f"where to append the rows (default {RUNS_CSV})")
    p.add_argument("--run-id", default=None, help="run id in the CSV (default: the UTC start time)")
    p.add_argument("--note", default="", help="a note stored with every row of this run")
    args = p.parse_args(argv)
    cpu_text = lscpu_text()
    print(cpu_line(cpu_text), flush=True)   # first: every benchmark says which CPU its numbers come from
    run_id = args.run_id or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    import onnxruntime
    import torch

    import kiln

    args.peak_gflops = peak_gflops(args.threads)
    print(f"kiln {kiln.__version__}, onnxruntime {onnxruntime.__version__}, torch {torch.__version__}; "
          f"threads={args.threads}, batch 1, {args.rounds} rounds x {args.runs} runs per engine; "
          f"measured fp32 peak {args.peak_gflops:.1f} GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if args.precision == "int8":   # quantized exports of the named networks (Q/DQ; dynamic for encoders)
            models = [m if m.endswith(("-int8", "-int8dyn", "-qdq", "-qat")) else f"{m}-int8" for m in models]
        results = [bench(m, Path(tmp), args) for m in models]
    names = sorted({k for r in results for k in r["medians"]}, key=lambda k: (k != "kiln", k))
    print(f"\n{'model':10}" + "".join(f"{n:>18}" for n in names) + f"{'kiln/ort':>10}{'kiln/best':>11}"
          f"{'kiln/bound':>12}{'build s':>9}{'load s':>8}")
    for r in results:
        print(f"{r['name']}: kiln's plan: {r['plan']}")
        if r.get("cosines"):
            print(f"{r['name']}: {r['bf16_layers']} BF16 layers; cosine to onnxruntime FP32 (of the FP32 network): " +
                  ", ".join(f"{k} {v:.6f}" for k, v in r["cosines"].items()))
        if "kiln fp32" in r["medians"]:
            print(f"{r['name']}: kiln INT8 is {r['medians']['kiln fp32'] / r['medians']['kiln']:.2f}x faster than "
                  "kiln FP32")
    for r in results:
        m = r["medians"]
        best = min(v for k, v in m.items() if not k.startswith("kiln"))
        print(f"{r['name']:10}" + "".join(f"{m.get(n, float('nan')):>18.2f}" for n in names) +
              f"{m['kiln'] / m['onnxruntime']:>10.3f}{m['kiln'] / best:>11.3f}{m['kiln'] / max(r['bound_ms'], 1e-9):>12.2f}"
              f"{r['build_s']:>9.1f}{r['load_s']:>8.2f}")
    if not args.no_record:
        note = "; ".join(filter(None, [args.note, "dynamo export" if args.exporter == "dynamo" else "",
                                       "dynamic axes" if args.dynamic else ""]))
        rows = run_rows(results, run_id, cpu_text, args.threads, git_commit(ROOT), note)
        append_rows(rows, args.results_csv)
        print(f"\nrecorded run {run_id} ({len(rows)} row(s)) in {args.results_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
