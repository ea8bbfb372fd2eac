"""Concatenation elision: a Concat input read by nothing else is written by its producer straight into the Concat's
output, and the results are exactly those of the plan run without elision (and onnxruntime's)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
import kiln.runtime.interpreter as interpreter
from kiln.tactics.views import row_step
from kiln.trt.build_log_reader import parse_build_log
from tests.conftest import assert_close_to_ort, make_model, run_ort

C = 8
OWN = "-openvino,-onnxruntime"


def _conv(name, src, dst, cin, cout, k, seed):
    w = np.random.default_rng(seed).standard_normal((cout, cin, k, k)).astype(np.float32) * 0.3
    return helper.make_node("Conv", [src, f"{name}_w"], [dst], name=name, pads=[k // 2] * 4), \
        numpy_helper.from_array(w, f"{name}_w")


def _yolo_like(batch, extra_output: str | None = None):
    """A C2f-like block: c1 = conv(x) split in two halves s0, s1; a = s1 + conv(s1); up = resize(maxpool(c1));
    g = sigmoid(conv(s1)); k = conv1x1(x); y = conv(concat(s0, s1, a, up, g, k)). s1 has three readers; the others
    only the Concat."""
    nodes, inits = [], []
    for args in [("c1", "x", "c1", C, 2 * C, 1, 0), ("c2", "s1", "c2", C, C, 3, 1), ("c3", "cat", "y", 7 * C, C, 1, 2),
                 ("c4", "x", "k", C, C, 1, 3)]:
        node, w = _conv(*args)
        nodes.append(node)
        inits.append(w)
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              [("st0", [0]), ("en0", [C]), ("st1", [C]), ("en1", [2 * C]), ("ax", [1])]]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes += [helper.make_node("Slice", ["c1", "st0", "en0", "ax"], ["s0"], name="slice0"),
              helper.make_node("Slice", ["c1", "st1", "en1", "ax"], ["s1"], name="slice1"),
              helper.make_node("Add", ["s1", "c2"], ["a"], name="add"),
              helper.make_node("MaxPool", ["c1"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("Resize", ["m", "", "scales"], ["up"], name="up", mode="nearest"),
              helper.make_node("Sigmoid", ["c2"], ["g"], name="gate"),
              helper.make_node("Concat", ["s0", "s1", "a", "up", "g", "k"], ["cat"], name="concat", axis=1)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, C, 8, 8])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, C, 8, 8])], outputs, inits)


def _contexts(engine, monkeypatch):
    """(a context with elision, one without)."""
    with_elision = engine.create_execution_context()
    monkeypatch.setattr(interpreter, "plan_elisions", lambda *args: ({}, {}))
    without = engine.create_execution_context()
    monkeypatch.undo()
    return with_elision, without


def _elided(context) -> dict[str, tuple[str, ...]]:
    return {s.layer.name: s.concat_rest.elided for s in context.interpreter.steps if s.concat_rest is not None}


def _layer_of(engine, onnx_name: str) -> str:
    return next(layer.name for layer in engine.plan.layers if onnx_name in layer.origin)


@pytest.mark.parametrize("extra_output", [None, "a"])
def test_sole_reader_producers_write_into_the_concat(monkeypatch, extra_output):
    model = _yolo_like(1, extra_output)
    engine = kiln.build(model, tactic_sources=OWN, autotune=False)
    with_elision, without = _contexts(engine, monkeypatch)
    producers = {_layer_of(engine, n) for n in ("slice0", "up", "gate", "add", "c4")}
    tactics = {l.name: l.tactic_name for l in engine.plan.layers}
    writers = {n for n in producers if n != _layer_of(engine, "gate") or tactics[n] == "torch.reference"}
    if extra_output:   # an engine output stays whole
        writers.discard(_layer_of(engine, "add"))
    assert set(_elided(with_elision)[_layer_of(engine, "concat")]) == writers, tactics
    x = np.random.default_rng(5).standard_normal((1, C, 8, 8)).astype(np.float32)
    storages = {}
    got = with_elision.execute({"x": x}, observe=lambda n, t: storages.setdefault(n, t.untyped_storage().data_ptr()))
    want = without.execute({"x": x})
    for name in got:
        np.testing.assert_array_equal(got[name], want[name])
    assert_close_to_ort(got["y"], run_ort(model, {"x": x})[0])
    shared = {n for n in ("s0", "s1", "a", "up", "g", "k") if storages[n] == storages["cat"]}
    assert shared == {t.outputs[0].name for t in engine.plan.layers if t.name in writers}


def test_dynamic_batch_reads_the_batch_from_the_producer(monkeypatch):
    model = _yolo_like("N")
    engine = kiln.build(model, tactic_sources=OWN, autotune=False, min_shapes=f"x:1x{C}x8x8",
                        opt_shapes=f"x:2x{C}x8x8", max_shapes=f"x:4x{C}x8x8")
    with_elision, without = _contexts(engine, monkeypatch)
    assert _elided(with_elision), "nothing elided in the dynamic-batch plan"
    for batch in (1, 3, 4):
        x = np.random.default_rng(batch).standard_normal((batch, C, 8, 8)).astype(np.float32)
        got = with_elision.execute({"x": x})["y"]
        np.testing.assert_array_equal(got, without.execute({"x": x})["y"])
        assert_close_to_ort(got, run_ort(model, {"x": x})[0])


def test_row_step_reads_a_slice_of_a_wider_tensor():
    hwc = (0, 2, 3, 1)
    wide = torch.empty(2, 48, 5, 7, memory_format=torch.channels_last)
    assert row_step(wide.narrow(1, 16, 16), hwc, 3) == 48
    assert row_step(wide, hwc, 3) == 48
    assert row_step(torch.empty(2, 16, 5, 7), (0, 1, 2, 3), 1) == 16 * 5 * 7
    assert row_step(torch.empty(2, 48, 5, 7).narrow(1, 16, 16), (0, 1, 2, 3), 1) == 48 * 5 * 7
    assert row_step(wide.narrow(1, 16, 16), (0, 1, 2, 3), 1) is None   # channel-major data is not row-major rows
    assert row_step(wide.narrow(3, 0, 3), hwc, 3) is None              # a column slice: rows are not evenly apart
    assert row_step(torch.empty(1, 16, 1, 1).narrow(1, 0, 8), hwc, 3) == 8   # one row: any step will do


def _verbose_build(model, caplog, **options):
    with caplog.at_level(logging.DEBUG, logger="kiln.build"):
        engine = kiln.build(model, tactic_sources=OWN, autotune=False, **options)
    return engine, [r.getMessage() for r in caplog.records if r.name == "kiln.build"]


def test_build_log_names_each_concat_input_and_why_it_is_copied(caplog):
    engine, lines = _verbose_build(_yolo_like(1, "a"), caplog)
    start = lines.index("Eliminating concatenation " + _layer_of(engine, "concat"))
    account = lines[start + 1:start + 7]
    tactic = {l.name: l.tactic_name for l in engine.plan.layers}
    gate = _layer_of(engine, "gate")
    gate_line = "Retargeting g to cat" if tactic[gate] == "torch.reference" else \
        f"Generating copy for g to cat because its producer {gate} ({tactic[gate]}) cannot write into a strided slice."
    assert account == ["Retargeting s0 to cat",
                       "Generating copy for s1 to cat because 2 other layers read it too.",
                       "Generating copy for a to cat because it is an engine output.",
                       "Retargeting up to cat", gate_line, "Retargeting k to cat"]
    # the log says what execution contexts do
    context = engine.create_execution_context()
    written = {s.outputs[0] for s in context.interpreter.steps if s.into_concat is not None}
    assert written == {line.split()[1] for line in account if line.startswith("Retargeting")}
    events = parse_build_log("\n".join(f"[V] [kiln] {line}" for line in lines), "build.log").events
    kinds = [e.kind for e in events if e.pass_name == "concat removal"]
    assert kinds == ["eliminating_concat"] + ["retargeting" if a.startswith("Retargeting") else "generating_copy"
                                              for a in account]


def test_build_log_says_why_a_concat_stays_whole(caplog):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Concat", ["r", "x"], ["cat"], name="batch_concat", axis=0),
             helper.make_node("Sigmoid", ["cat"], ["y"], name="gate")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, C, 4, 4])])
    engine, lines = _verbose_build(model, caplog)
    concat = _layer_of(engine, "batch_concat")
    assert f"Not eliminating concatenation {concat}: it concatenates along the batch axis" in lines
    assert not any(line.startswith(("Retargeting", "Generating copy")) for line in lines)
