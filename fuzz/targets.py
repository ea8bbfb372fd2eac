"""Fuzz targets shared by the hypothesis tests (tests/reliability/test_fuzz.py) and the coverage-guided atheris
run (`make fuzz`, fuzz/run_atheris.py): each takes bytes and must either succeed or raise a `kiln.Error`.

- engine: `plan_from_bytes` on a real engine's bytes, mutated; half the mutations then re-seal the checksum,
  so the JSON plan and the safetensors weights are parsed, not just the header.
- onnx: `import_onnx` on a real model's protobuf bytes, mutated.
- trt: `read_text` / `parse_build_log` on real trtexec layer info, one-line dumps and verbose logs, mutated.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TRT_FIXTURES = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".json", ".log"))


def seed_engine() -> bytes:
    """A small real engine (conv, relu, pool, gemm) built once."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import kiln

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 10)).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "fc"], ["y"])]
    graph = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return _engine_bytes(kiln.build(model, autotune=False))


def _engine_bytes(engine) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        engine.save(Path(tmp) / "seed.kiln")
        return (Path(tmp) / "seed.kiln").read_bytes()


def seed_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape"], ["y"], name="reshape")]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [2, 3, 3, 3], [0.1] * 54),
             helper.make_tensor("shape", TensorProto.INT64, [2], [1, -1])]
    graph = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def reseal(data: bytes) -> bytes:
    """Recompute an engine's checksum over its (mutated) body, so parsing goes past the integrity check."""
    from kiln.plan.serialize import HEADER

    if len(data) < HEADER.size:
        return data
    magic, version, flags, json_len, weights_len, _ = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    digest = hashlib.sha256(body).digest()
    return HEADER.pack(magic, version, flags, json_len, weights_len, digest) + body


def mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: 0 flip a byte, 1 delete a byte, 2 insert a byte, 3 truncate."""
    buf = bytearray(data)
    for kind, pos, value in ops:
        if not buf:
            break
        pos %= len(buf)
        if kind == 0:
            buf[pos] ^= (value % 255) + 1
        elif kind == 1:
            del buf[pos]
        elif kind == 2:
            buf.insert(pos, value % 256)
        else:
            del buf[pos:]
    return bytes(buf)


def target_engine(data: bytes) -> None:
    import kiln
    from kiln.plan.serialize import plan_from_bytes

    try:
        plan = plan_from_bytes(data, "<fuzzed engine>")
    except kiln.Error:
        return
    from kiln.runtime.engine import Engine

    import numpy as np

    if any(np.prod(t.dims, dtype=np.float64) > 1 << 20 or min(t.dims, default=1) < 1 for t in plan.inputs):
        return   # a mutated but well-formed input size: running it would only measure the allocator
    try:   # a plan that parses must also load and run, or be refused cleanly
        engine = Engine(plan)
        engine.run(engine.random_inputs())
    except kiln.Error:
        return


def target_onnx(data: bytes) -> None:
    import onnx

    import kiln
    from kiln.frontend import import_onnx

    try:
        model = onnx.ModelProto.FromString(data)
    except Exception:   # not protobuf at all: kiln's file loader reports that as ModelError (tested elsewhere)
        return
    try:
        import_onnx(model)
    except kiln.Error:
        return


def target_trt(data: bytes) -> None:
    import kiln
    from kiln.trt.artifacts import read_text
    from kiln.trt.build_log_reader import parse_build_log

    text = data.decode("utf-8", errors="replace")
    for fn in (read_text, parse_build_log):
        try:
            fn(text, "<fuzzed artifact>")
        except kiln.Error:
            pass
