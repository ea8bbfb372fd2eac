"""Engine files (.kiln): a fixed header, a JSON plan and safetensors weights, checksummed; never pickle.

Layout: magic "KILNPLAN" | format version u32 | flags u32 | JSON length u64 | weights length u64 |
SHA-256 of (JSON + weights) | JSON bytes | safetensors bytes. Writes go to a temp file, then rename.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save as st_save

from kiln.plan.model import Arg, Layer, MemoryPlan, Plan, TensorDesc
from kiln.fileio import atomic_write_bytes, atomic_write_text  # noqa: F401  (re-exported)
from kiln.errors import EngineFormatError
from kiln.plan.model import ShapeRange
from kiln.plan.weights_view import weight_views

MAGIC = b"KILNPLAN"
FORMAT_VERSION = 2   # 2: layers record their tactic source; TensorRT's type names are derived, not stored
HEADER = struct.Struct("<8sIIQQ32s")
MAX_JSON_BYTES = 1 << 30
WEIGHTS_ALIGNMENT = 64
READ_CHUNK_BYTES = 16 << 20


def encode_value(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"__ndarray__": v.tolist(), "dtype": str(v.dtype), "shape": list(v.shape)}
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    if isinstance(v, dict):
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    return v


def decode_value(v: Any) -> Any:
    if isinstance(v, dict):
        if "__ndarray__" in v:
            return np.array(v["__ndarray__"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


def _tensor(d: TensorDesc) -> dict:
    out = {"name": d.name, "dims": list(d.dims), "dtype": d.dtype, "format": d.format}
    if d.dynamic:
        out["dynamic"] = list(d.dynamic)
    return out


def _profiles_json(plan: Plan) -> list[dict]:
    return [{name: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for name, r in p.items()}
            for p in plan.profiles]


def _profiles_from_json(doc: list) -> tuple[dict[str, ShapeRange], ...]:
    def shape(x) -> tuple[int, ...]:
        return tuple(int(d) for d in x)

    return tuple({str(name): ShapeRange(shape(r["min"]), shape(r["opt"]), shape(r["max"])) for name, r in p.items()}
                 for p in doc)


def _layer_json(l: Layer) -> dict:
    return {
        "name": l.name, "op_type": l.op_type, "domain": l.domain, "args": [[a.kind, a.name] for a in l.args],
        "inputs": [_tensor(t) for t in l.inputs], "outputs": [_tensor(t) for t in l.outputs],
        "attrs": encode_value(l.attrs), "tactic_name": l.tactic_name, "tactic_value": l.tactic_value,
        "source": l.source, "origin": list(l.origin), "precision": l.precision,
        "inner": [_layer_json(i) for i in l.inner], "requested_precision": l.requested_precision, "precision_reason": l.precision_reason,
    }


def plan_to_json(plan: Plan) -> dict:
    layers = [_layer_json(l) for l in plan.layers]
    m = plan.memory
    return {
        "format_version": FORMAT_VERSION, "name": plan.name,
        "inputs": [_tensor(t) for t in plan.inputs], "outputs": [_tensor(t) for t in plan.outputs],
        "layers": layers, "build_info": dict(plan.build_info),
        "profiles": _profiles_json(plan),
        "memory": {"total_bytes": m.total_bytes, "unshared_bytes": m.unshared_bytes, "offsets": m.offsets,
                   "free_after": [list(f) for f in m.free_after]},
    }


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    body = json.dumps(plan_to_json(plan), separators=(",", ":")).encode("utf-8")
    body += b" " * (-(HEADER.size + len(body)) % WEIGHTS_ALIGNMENT)   # weights start aligned: loads view them in place
    weights = st_save({k: np.ascontiguousarray(v).reshape(v.shape) for k, v in plan.weights.items()}) if plan.weights else b""
    h = hashlib.sha256(body)
    h.update(weights)
    digest = h.digest()
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), len(weights), digest)
    atomic_write_bytes(path, [header, body, weights])


def load_plan(path: str | os.PathLike) -> Plan:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data, digest = _read_hashing(f, os.fstat(f.fileno()).st_size)
    except OSError as exc:
        raise EngineFormatError(f"{path}: cannot read engine file ({exc.strerror or exc})") from None
    return _plan_from_buffer(data, str(path), digest)


def _read_hashing(f, size: int) -> tuple[memoryview, bytes]:
    """The file's bytes (writable: the weights view them) and the SHA-256 of all after the fixed header. A second
    thread hashes each chunk while the next is read, so on two cores the checksum adds almost no load time."""
    data = memoryview(np.empty(size, np.uint8))   # no zero-fill: every byte is read into
    h = hashlib.sha256()
    head = f.readinto(data[:HEADER.size])
    pos = head
    with ThreadPoolExecutor(1) as hasher:   # one worker: chunks are hashed in order
        while pos < size:
            n = f.readinto(data[pos:pos + READ_CHUNK_BYTES])
            if not n:
                break
            hasher.submit(h.update, data[pos:pos + n])
            pos += n
    return data[:pos], h.digest() if head == HEADER.size else b""


def plan_from_bytes(data: bytes | bytearray, where: str = "<bytes>") -> Plan:
    """The plan in an engine file's bytes; its weights view a writable copy of the weights section."""
    return _plan_from_buffer(memoryview(bytearray(data)), where, hashlib.sha256(memoryview(data)[HEADER.size:]).digest())


def _plan_from_buffer(view: memoryview, where: str, rest_sha256: bytes) -> Plan:
    """`view`: the whole file, writable (the weights are views into it); `rest_sha256`: hash of all after the header."""
    if len(view) < HEADER.size or view[:8] != MAGIC:
        raise EngineFormatError(f"{where}: not a kiln engine file (bad magic); build one with `kiln build`")
    magic, version, _flags, json_len, weights_len, digest = HEADER.unpack_from(view)
    if version > FORMAT_VERSION:
        raise EngineFormatError(f"{where}: engine format version {version} is newer than this kiln supports "
                                f"({FORMAT_VERSION}); upgrade kiln or rebuild the engine")
    if version < 1:
        raise EngineFormatError(f"{where}: engine format version {version} is not valid")
    if version < FORMAT_VERSION:
        raise EngineFormatError(f"{where}: engine format version {version} was written by an older kiln; this kiln "
                                f"reads version {FORMAT_VERSION}: rebuild the engine from its ONNX model")
    expected = HEADER.size + json_len + weights_len
    if json_len > MAX_JSON_BYTES or len(view) < expected:
        raise EngineFormatError(f"{where}: engine file is truncated ({len(view)} bytes, header promises {expected})")
    if len(view) > expected:
        raise EngineFormatError(f"{where}: engine file has {len(view) - expected} unexpected trailing bytes")
    body = bytes(view[HEADER.size:HEADER.size + json_len])
    weights = view[HEADER.size + json_len:expected]
    if rest_sha256 != digest:
        raise EngineFormatError(f"{where}: checksum mismatch: the engine file was modified or corrupted; rebuild it")
    try:
        doc = json.loads(body)
        tensors = weight_views(weights) if weights_len else {}
        plan = _plan_from_json(doc, tensors)
        return plan
    except EngineFormatError:
        raise
    except Exception as exc:
        raise EngineFormatError(f"{where}: engine contents are invalid ({type(exc).__name__}: {exc})") from None


def _desc(d: dict) -> TensorDesc:
    return TensorDesc(str(d["name"]), tuple(int(x) for x in d["dims"]), str(np.dtype(d["dtype"])), str(d["format"]),
                      tuple(int(x) for x in d.get("dynamic", ())))


def _layer_from_json(l: dict) -> Layer:
    return Layer(
        name=l["name"], op_type=l["op_type"], domain=l["domain"], args=tuple(Arg(k, n) for k, n in l["args"]),
        inputs=tuple(_desc(t) for t in l["inputs"]), outputs=tuple(_desc(t) for t in l["outputs"]),
        attrs=decode_value(l["attrs"]), tactic_name=l["tactic_name"], tactic_value=int(l["tactic_value"]),
        source=str(l["source"]), origin=tuple(l["origin"]), precision=l.get("precision", "FP32"),
        inner=tuple(_layer_from_json(i) for i in l.get("inner", [])),
        requested_precision=str(l.get("requested_precision", "")), precision_reason=str(l.get("precision_reason", "")),
    )


def _check_dataflow(doc: dict, layers: tuple[Layer, ...]) -> None:
    """Every tensor a layer reads is an engine input or an earlier layer's output; every engine output is
    produced; the memory plan has one entry per layer (a hand-edited plan fails here, not mid-inference)."""
    known = {str(t["name"]) for t in doc["inputs"]}
    for layer in layers:
        for a in layer.args:
            if a.kind not in ("tensor", "weight", "none"):
                raise EngineFormatError(f"layer '{layer.name}' has an argument of unknown kind '{a.kind}'")
            if a.kind == "tensor" and a.name not in known:
                raise EngineFormatError(f"layer '{layer.name}' reads tensor '{a.name}', which no earlier layer produces")
        known.update(t.name for t in layer.outputs)
    missing = [str(t["name"]) for t in doc["outputs"] if str(t["name"]) not in known]
    if missing:
        raise EngineFormatError(f"engine output(s) {missing} are produced by no layer")
    if len(doc["memory"]["free_after"]) != len(layers):
        raise EngineFormatError(f"memory plan lists {len(doc['memory']['free_after'])} layers, the plan has {len(layers)}")


def _plan_from_json(doc: dict, weights: dict[str, np.ndarray]) -> Plan:
    if doc.get("format_version") != FORMAT_VERSION:
        raise EngineFormatError(f"engine JSON declares format version {doc.get('format_version')}")
    layers = tuple(_layer_from_json(l) for l in doc["layers"])
    for layer in [x for l in layers for x in (l, *l.inner)]:
        for a in layer.args:
            if a.kind == "weight" and a.name not in weights:
                raise EngineFormatError(f"layer '{layer.name}' refers to missing weight '{a.name}'")
    _check_dataflow(doc, layers)
    m = doc["memory"]
    memory = MemoryPlan(int(m["total_bytes"]), int(m["unshared_bytes"]), {k: int(v) for k, v in m["offsets"].items()},
                        tuple(tuple(f) for f in m["free_after"]))
    return Plan(doc["name"], tuple(_desc(t) for t in doc["inputs"]), tuple(_desc(t) for t in doc["outputs"]),
                layers, weights, memory, doc.get("build_info", {}), _profiles_from_json(doc.get("profiles", [])))
