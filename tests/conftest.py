"""Shared test helpers: onnxruntime reference runs and the tolerance rule."""
from __future__ import annotations

import contextlib
import logging
import threading

import numpy as np
import pytest
import torch

torch.manual_seed(0)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def kiln_logger_restored():
    """Each test gets the 'kiln' logger back as it found it. A CLI command run in-process
    (kiln.cli.console.setup_logging) gives it a handler on that test's captured stdout and stops propagation; in
    one full run a later test of the same worker then logged to the closed capture ("I/O operation on closed
    file") and its caplog saw none of kiln.build's records."""
    logger = logging.getLogger("kiln")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def on_threads(worker, count: int) -> None:
    """worker(0) .. worker(count - 1), each on a thread of its own, all started before any is joined."""
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def torch_threads(count: int):
    """torch (and kiln's OpenMP kernels) on `count` threads inside the block, the suite's one thread after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_one_step_at_most(got: np.ndarray, want: np.ndarray, exact: float = 0.99, spread: int = 50) -> None:
    """Quantized outputs equal but for rare values a step apart (float arithmetic a few ulps from the reference's
    lands near a rounding boundary): the same type, at least `exact` of them equal, more than `spread` levels."""
    assert got.dtype == want.dtype and len(np.unique(want)) > spread
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and (diff == 0).mean() >= exact


def assert_int8_layer_matches_onnxruntime(model, feeds: dict[str, np.ndarray], layer: tuple[str, str, str],
                                          out_dtype, exact: float, spread: int) -> None:
    """`model` builds into one INT8 layer, `layer` = (name, op type, tactic), whose output is within a step of
    onnxruntime's unfused run (`assert_one_step_at_most`); so is the same layer on torch's reference kernel."""
    import kiln

    engine = kiln.build(model, autotune=False)
    assert [(l.name, l.op_type, l.tactic_name, l.precision) for l in engine.plan.layers] == [(*layer, "INT8")]
    got, want = engine.run(feeds)["y"], unfused_onnxruntime(model, feeds)
    assert got.dtype == out_dtype
    assert_one_step_at_most(got, want, exact=exact, spread=spread)
    reference = kiln.build(model, tactic_sources="torch", autotune=False)
    assert [l.tactic_name for l in reference.plan.layers] == ["torch.reference"]
    assert np.abs(reference.run(feeds)["y"].astype(np.int32) - want).max() <= 1


def cosine(a, b) -> float:
    """Cosine similarity of two arrays, flattened, in float64 (how reduced-precision outputs are scored)."""
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def run_ort(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close_to_ort(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-4) -> None:
    """The project's rule: max |kiln - ort| <= rel * max |ort| (exact match for non-float outputs)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_array_equal(actual, expected)
        return
    scale = max(float(np.abs(expected).max()), 1e-12)
    err = float(np.abs(actual.astype(np.float64) - expected).max())
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * {scale:.3g}"


@pytest.fixture
def tmp_engine(tmp_path):
    return tmp_path / "model.kiln"


def unfused_onnxruntime(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The first output of onnxruntime with its graph optimizations off: each node on its own, as the ONNX spec
    defines it (its fused Q/DQ paths round differently, and some quantize activations too)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17, name: str = "test"):
    """A ModelProto onnxruntime accepts (onnx >= 1.23 defaults to an IR version newer than ORT reads)."""
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def rand(shape, seed=0, positive=False):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.abs(a) + 0.1 if positive else a


def init(name, arr):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(arr), name)


def force_plan(monkeypatch, winner: str = "onnxruntime") -> None:
    """Make the whole-plan timing pick `winner` (the others time 10x slower), so a test about what a region
    looks like does not depend on which plan this machine happens to run fastest. Plans are still built and
    their outputs checked against onnxruntime; only the clock is replaced."""
    import kiln.planning.race as race

    real = race.measure_plans

    def measured(candidates, *args, **kwargs):
        assert winner in candidates, f"the {winner} plan was not built (candidates: {', '.join(candidates)})"
        assert winner in real({winner: candidates[winner]}, *args, **kwargs), f"the {winner} plan is wrong"
        return {name: (1.0 if name == winner else 10.0) for name in candidates}
    monkeypatch.setattr(race, "measure_plans", measured)
