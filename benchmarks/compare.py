"""kiln against its peers on CPU, batch 1, in one process: onnxruntime, OpenVINO (if installed), torch eager
and torch.compile (with --compile; its first call takes minutes).

    make bench                                     # = .venv/bin/python benchmarks/compare.py
    .venv/bin/python benchmarks/compare.py --models resnet18,resnet50 --runs 30 --rounds 3 --threads 2

Networks are built from torch code (tests/models/nets.py, random weights, randomized BatchNorm statistics) and
exported with the legacy exporter to a temporary folder. Every engine gets 5 warm-up runs; then timed blocks of
--runs inferences rotate through the engines --rounds times, so drift hits all alike; medians are over all
timed runs. Reported: median ms per engine, kiln's ratio to onnxruntime and to the best peer, kiln's build time
(cold timing cache) and load time, and kiln's ratio to the compute lower bound (FLOPs / 186.6 GFLOP/s, the best
fp32 matmul throughput measured on this machine with 2 threads).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 5
PEAK_GFLOPS = 186.6


def flops(plan) -> float:
    """Multiply-adds x2 of convolutions and matrix products in a kiln plan (regions included)."""
    total = 0.0
    for layer in [i for l in plan.layers for i in (l.inner or (l,))]:
        out = layer.outputs[0].dims if layer.outputs else ()
        if layer.op_type == "Conv":
            w = plan.weights[layer.args[1].name].shape
            total += 2 * np.prod(out) * np.prod(w[1:])
        elif layer.op_type in ("Gemm", "MatMul") and layer.args[1].kind == "weight":
            k = plan.weights[layer.args[1].name].shape
            total += 2 * np.prod(out) * (k[1] if layer.attrs.get("transB") else k[0])
    return float(total)


def peers(onnx_path: str, model, x: np.ndarray, threads: int, with_compile: bool):
    """name -> zero-argument callable running one inference."""
    import onnxruntime as ort
    import torch

    out = {}
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    out["onnxruntime"] = lambda: sess.run(None, {name: x})
    try:
        import openvino as ov

        compiled = ov.Core().compile_model(onnx_path, "CPU", {"INFERENCE_NUM_THREADS": threads})
        request = compiled.create_infer_request()
        out["openvino"] = lambda: request.infer({0: x})
    except ImportError:
        pass
    tx = torch.from_numpy(x)
    out["torch eager"] = lambda: model(tx)
    if with_compile:
        compiled_model = torch.compile(model)
        out["torch.compile"] = lambda: compiled_model(tx)
    return out


def bench(name: str, workdir: Path, args) -> dict:
    import torch

    import kiln
    from tests.models.nets import export, make

    torch.set_num_threads(args.threads)
    model = make(name, seed=0)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    path = workdir / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(model, torch.from_numpy(x), path, "legacy")
    t0 = time.perf_counter()
    engine = kiln.build(str(path))
    build_s = time.perf_counter() - t0
    engine.save(workdir / f"{name}.kiln")
    t0 = time.perf_counter()
    engine = kiln.load(workdir / f"{name}.kiln")
    engine.kernels   # load = read + verify + prepare every kernel
    load_s = time.perf_counter() - t0
    ctx = engine.create_execution_context()
    feed = {engine.input_names[0]: x}
    runners = {"kiln": lambda: ctx.execute(feed), **peers(str(path), model, x, args.threads, args.compile)}
    with torch.inference_mode():
        for fn in runners.values():
            for _ in range(WARMUP):
                fn()
        samples = {k: [] for k in runners}
        for _ in range(args.rounds):
            for k, fn in runners.items():
                for _ in range(args.runs):
                    t = time.perf_counter()
                    fn()
                    samples[k].append((time.perf_counter() - t) * 1e3)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    bound_ms = flops(engine.plan) / (PEAK_GFLOPS * 1e9) * 1e3
    return {"name": name, "medians": medians, "build_s": build_s, "load_s": load_s, "bound_ms": bound_ms,
            "layers": len(engine.plan.layers)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time torch.compile (slow first call)")
    args = p.parse_args(argv)
    import onnxruntime
    import torch

    import kiln

    print(f"kiln {kiln.__version__}, onnxruntime {onnxruntime.__version__}, torch {torch.__version__}; "
          f"threads={args.threads}, batch 1, {args.rounds} rounds x {args.runs} runs per engine")
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench(m.strip(), Path(tmp), args) for m in args.models.split(",") if m.strip()]
    names = sorted({k for r in results for k in r["medians"]}, key=lambda k: (k != "kiln", k))
    print(f"\n{'model':10}" + "".join(f"{n:>15}" for n in names) + f"{'kiln/ort':>10}{'kiln/best':>11}"
          f"{'kiln/bound':>12}{'build s':>9}{'load s':>8}")
    for r in results:
        m = r["medians"]
        best = min(v for k, v in m.items() if k != "kiln")
        print(f"{r['name']:10}" + "".join(f"{m.get(n, float('nan')):>15.2f}" for n in names) +
              f"{m['kiln'] / m['onnxruntime']:>10.3f}{m['kiln'] / best:>11.3f}{m['kiln'] / r['bound_ms']:>12.2f}"
              f"{r['build_s']:>9.1f}{r['load_s']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
