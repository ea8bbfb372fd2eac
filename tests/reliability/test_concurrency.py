"""One engine shared by 8 threads, each with its own execution context, gives exactly the serial outputs over
many iterations: kiln's own kernels, an onnxruntime region plan, an OpenVINO region plan, and the fused-attention
encoder."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import kiln
from tests.conftest import force_plan, make_model

THREADS, ITERATIONS = 8, 25


def cnn():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal((8, 10)).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Add", ["c", "b"], ["d"]),
             helper.make_node("GlobalAveragePool", ["d"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "fc"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def hammer(engine, inputs):
    """Serial outputs first; then THREADS threads, each its own context, run every input ITERATIONS times."""
    expected = [engine.run(f) for f in inputs]
    failures, barrier = [], threading.Barrier(THREADS)

    def worker(k: int):
        ctx = engine.create_execution_context()
        barrier.wait()
        for i in range(ITERATIONS):
            j = (k + i) % len(inputs)
            got = ctx.execute(inputs[j])
            for name, value in expected[j].items():
                if not np.array_equal(got[name], value):
                    failures.append((k, i, name))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return failures


@pytest.mark.parametrize("plan", ["kiln kernels", "kiln", "onnxruntime", "openvino"])
def test_threads_with_own_contexts_match_serial_runs(plan, monkeypatch):
    if plan == "kiln kernels":
        engine = kiln.build(cnn(), autotune=False)
    else:
        if plan == "openvino":
            pytest.importorskip("openvino")
        force_plan(monkeypatch, plan)   # the whole graph as one region of that library
        engine = kiln.build(cnn(), avg_timing=1, min_timing=1)
        regions = [layer.tactic_name for layer in engine.plan.layers if layer.inner]
        assert regions == ([] if plan == "kiln" else [f"{plan}.region"])
    inputs = [{"x": np.random.default_rng(s).standard_normal((1, 3, 16, 16)).astype(np.float32)} for s in range(5)]
    assert hammer(engine, inputs) == [], plan


def test_threads_on_a_dynamic_attention_engine(tmp_path):
    from tests.engine.test_dynamic_shapes import SEQ_PROFILE, TinyEncoder, feeds

    import torch
    import warnings

    path = tmp_path / "enc.onnx"
    axes = {0: "b", 1: "s"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(TinyEncoder().eval(), (torch.randint(0, 100, (2, 16)), torch.ones(2, 16)), str(path),
                          input_names=["ids", "mask"], output_names=["y"], dynamic_axes={"ids": axes, "mask": axes},
                          dynamo=False, opset_version=17)
    engine = kiln.build(str(path), profiles=[SEQ_PROFILE], autotune=False)
    inputs = [feeds(b, s, seed=b * s) for b, s in [(1, 4), (2, 16), (3, 40), (4, 64)]]
    assert hammer(engine, inputs) == []


def test_contexts_share_weights():
    engine = kiln.build(cnn(), autotune=False)
    a, b = engine.create_execution_context(), engine.create_execution_context()
    assert a.kernels is b.kernels   # prepared (prepacked) once per engine; activations live per call


def test_threads_take_the_engines_thread_count_not_openmps_default():
    """A new thread starts at OpenMP's default team (every core; 16 here), not the count the engine was built
    with (1): contexts running there adopt the engine's, so they split their sums as the serial runs do and give
    the same bits, on a 2-core machine as on a 16-core one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import numpy as np, torch, kiln\n"
            "torch.set_num_threads(1)\n"
            "from tests.reliability.test_concurrency import cnn, hammer\n"
            "engine = kiln.build(cnn(), autotune=False)\n"
            "inputs = [{'x': np.random.default_rng(s).standard_normal((1, 3, 16, 16)).astype(np.float32)} "
            "for s in range(5)]\n"
            "print('mismatches', len(hammer(engine, inputs)))\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "16", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["mismatches", "0"], done.stdout


def test_a_run_uses_the_engines_thread_count_and_gives_the_callers_back():
    import torch

    before = torch.get_num_threads()
    engine = kiln.build(cnn(), autotune=False, threads=1)
    seen = []
    try:
        torch.set_num_threads(2)   # the caller's own count, changed after the build
        context = engine.create_execution_context()
        feeds = {"x": np.zeros((1, 3, 16, 16), np.float32)}
        context.execute(feeds, observe=lambda *_: seen.append(torch.get_num_threads()))
        assert engine.threads == 1 and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
