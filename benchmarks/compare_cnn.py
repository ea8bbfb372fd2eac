"""Latency of kiln vs onnxruntime on ResNet-18 / ResNet-50 (batch 1, 3x224x224, CPU, same process).

Run it with

    make bench                                   # = .venv/bin/python benchmarks/compare_cnn.py
    .venv/bin/python benchmarks/compare_cnn.py --models resnet18,resnet50 --runs 30 --threads 2

The networks come from tests/models/nets.py (random weights, randomized BatchNorm statistics) and are
exported with the legacy TorchScript exporter (opset 17, BatchNormalization kept) to a temporary directory.
onnxruntime runs with intra_op_num_threads=--threads, inter_op_num_threads=1 and ORT_ENABLE_ALL; kiln runs
with torch.set_num_threads(--threads). Each engine gets 5 warm-up runs, then timed blocks of --runs runs
alternate (ort, kiln, ort, kiln, ... --rounds times) so that clock/thermal drift hits both alike; the medians
are over all timed runs. The last column is max |kiln - ort| / max |ort| on a fixed random input.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 5


def time_block(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench_model(name: str, workdir: Path, runs: int, rounds: int, threads: int) -> dict:
    import onnxruntime as ort
    import torch

    import kiln
    from tests.models.nets import export, make

    path = workdir / f"{name}.onnx"
    export_s = export(make(name, seed=0), torch.randn(1, 3, 224, 224), path, "legacy")

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    t0 = time.perf_counter()
    engine = kiln.build(str(path))
    build_s = time.perf_counter() - t0

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    feeds = {"input": x}
    ref = sess.run(None, feeds)[0]
    got = engine.run(feeds)["output"]
    rel_err = float(np.abs(got.astype(np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-12))

    run_ort = lambda: sess.run(None, feeds)       # noqa: E731
    run_kiln = lambda: engine.run(feeds)          # noqa: E731
    for _ in range(WARMUP):
        run_ort()
    for _ in range(WARMUP):
        run_kiln()
    t_ort: list[float] = []
    t_kiln: list[float] = []
    blocks: list[str] = []      # per-block medians: a block far off its twin means other load on the machine
    for _ in range(rounds):
        b_ort, b_kiln = time_block(run_ort, runs), time_block(run_kiln, runs)
        blocks.append(f"ort {statistics.median(b_ort):.1f} / kiln {statistics.median(b_kiln):.1f}")
        t_ort += b_ort
        t_kiln += b_kiln
    return {"model": name, "ort": statistics.median(t_ort), "kiln": statistics.median(t_kiln),
            "n": len(t_ort), "rel_err": rel_err, "export_s": export_s, "build_s": build_s,
            "layers": len(engine.plan.layers), "blocks": blocks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,resnet50", help="comma-separated: resnet18,resnet50")
    ap.add_argument("--runs", type=int, default=30, help="timed runs per block (default 30)")
    ap.add_argument("--rounds", type=int, default=2, help="(ort, kiln) block pairs per model (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads for both engines (default 2)")
    args = ap.parse_args(argv)

    import logging

    import onnxruntime as ort
    import torch

    import kiln

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"kiln {kiln.__version__}, onnxruntime {ort.__version__}, torch {torch.__version__}; "
          f"threads={args.threads}, batch 1x3x224x224, {WARMUP} warm-ups, "
          f"{args.rounds} x {args.runs} timed runs per engine")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for name in models:
            r = bench_model(name, Path(tmp), args.runs, args.rounds, args.threads)
            print(f"  {name}: exported in {r['export_s']:.1f}s, kiln build {r['build_s']:.2f}s, "
                  f"{r['layers']} layers; block medians (ms): {', '.join(r['blocks'])}", flush=True)
            rows.append(r)
    print()
    print(f"{'model':<10} {'ort ms':>9} {'kiln ms':>9} {'kiln/ort':>9} {'max rel err':>12}")
    for r in rows:
        print(f"{r['model']:<10} {r['ort']:>9.2f} {r['kiln']:>9.2f} {r['kiln'] / r['ort']:>9.2f} "
              f"{r['rel_err']:>12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
