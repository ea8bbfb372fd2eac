"""Engine files: exact save/load round trips, clear errors for damaged files, atomic writes, and no pickle."""
import os
import pathlib
import re
import struct

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.plan.serialize import HEADER, plan_from_bytes
from kiln.errors import EngineFormatError
from tests.conftest import make_model

KILN_SRC = pathlib.Path(kiln.__file__).parent


def _model():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.float32(0.5), "half"),
             numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Reshape", ["p", "shape"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "W2"], ["m"], name="fc"),
             helper.make_node("Mul", ["m", "half"], ["y"], name="scale")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)


@pytest.fixture(scope="module")
def engine():
    return kiln.build(_model())


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "model.kiln"
    engine.save(path)
    return path.read_bytes()


X = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)


def test_round_trip_identical(engine, tmp_engine):
    engine.save(tmp_engine)
    loaded = kiln.load(tmp_engine)
    np.testing.assert_array_equal(loaded.run({"x": X})["y"], engine.run({"x": X})["y"])
    assert [l.name for l in loaded.plan.layers] == [l.name for l in engine.plan.layers]
    assert [l.tactic_name for l in loaded.plan.layers] == [l.tactic_name for l in engine.plan.layers]
    assert [l.origin for l in loaded.plan.layers] == [l.origin for l in engine.plan.layers]
    assert loaded.plan.inputs == engine.plan.inputs and loaded.plan.outputs == engine.plan.outputs
    assert loaded.plan.memory == engine.plan.memory
    assert sorted(loaded.plan.weights) == sorted(engine.plan.weights)
    assert loaded.plan.weights["half"].shape == ()   # 0-d weights stay 0-d
    for k, w in engine.plan.weights.items():
        assert loaded.plan.weights[k].dtype == w.dtype and loaded.plan.weights[k].shape == w.shape
        np.testing.assert_array_equal(loaded.plan.weights[k], w)


def test_double_round_trip_is_byte_identical(saved, tmp_path):
    first = tmp_path / "a.kiln"
    first.write_bytes(saved)
    kiln.load(first).save(tmp_path / "b.kiln")
    assert (tmp_path / "b.kiln").read_bytes() == saved


def test_round_trip_keeps_attrs(engine, saved):
    plan = plan_from_bytes(saved)
    for before, after in zip(engine.plan.layers, plan.layers):
        assert after.attrs.keys() == before.attrs.keys(), before.name
        assert after.source == before.source and after.tactic_name == before.tactic_name


def test_header_layout(saved):
    magic, version, flags, json_len, weights_len, _digest = HEADER.unpack_from(saved)
    assert (magic, version, flags) == (b"KILNPLAN", 2, 0)
    assert len(saved) == HEADER.size + json_len + weights_len


# ---------------------------------------------------------------- damaged files
def _load_bytes(tmp_path, data):
    path = tmp_path / "bad.kiln"
    path.write_bytes(data)
    with pytest.raises(EngineFormatError) as info:
        kiln.load(path)
    assert "bad.kiln" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated(saved, tmp_path, keep):
    assert "truncated" in _load_bytes(tmp_path, saved[: int(len(saved) * keep)])


def test_truncated_inside_header(saved, tmp_path):
    msg = _load_bytes(tmp_path, saved[: HEADER.size - 4])
    assert "truncated" in msg or "not a kiln engine" in msg


def test_flipped_byte_fails_checksum(saved, tmp_path):
    data = bytearray(saved)
    middle = HEADER.size + (len(saved) - HEADER.size) // 2
    data[middle] ^= 0x01
    assert "checksum" in _load_bytes(tmp_path, bytes(data))


def test_flipped_digest_byte_fails_checksum(saved, tmp_path):
    data = bytearray(saved)
    data[HEADER.size - 1] ^= 0xFF
    assert "checksum" in _load_bytes(tmp_path, bytes(data))


def test_newer_format_version(saved, tmp_path):
    data = bytearray(saved)
    data[8:12] = struct.pack("<I", 99)
    msg = _load_bytes(tmp_path, bytes(data))
    assert "newer" in msg and "99" in msg


def test_older_format_version_asks_for_a_rebuild(saved, tmp_path):
    """Version 1 engines stored TensorRT's type names per layer and no tactic source: this kiln refuses them."""
    data = bytearray(saved)
    data[8:12] = struct.pack("<I", 1)
    msg = _load_bytes(tmp_path, bytes(data))
    assert "engine format version 1 was written by an older kiln; this kiln reads version 2: rebuild the engine" in msg


def test_zero_format_version(saved, tmp_path):
    data = bytearray(saved)
    data[8:12] = struct.pack("<I", 0)
    assert "not valid" in _load_bytes(tmp_path, bytes(data))


def test_random_file_is_not_an_engine(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert "not a kiln engine" in _load_bytes(tmp_path, noise)


def test_empty_file_is_not_an_engine(tmp_path):
    assert "not a kiln engine" in _load_bytes(tmp_path, b"")


def test_onnx_file_is_not_an_engine(tmp_path):
    assert "not a kiln engine" in _load_bytes(tmp_path, _model().SerializeToString())


def test_trailing_bytes(saved, tmp_path):
    assert "trailing" in _load_bytes(tmp_path, saved + b"\0\0\0\0")


def test_missing_engine_file(tmp_path):
    with pytest.raises(EngineFormatError, match="cannot read"):
        kiln.load(tmp_path / "absent.kiln")


def test_valid_checksum_but_invalid_json(saved, tmp_path):
    import hashlib

    magic, version, flags, json_len, weights_len, _ = HEADER.unpack_from(saved)
    body = b"{not json" + b" " * (json_len - 9)
    weights = saved[HEADER.size + json_len:]
    header = HEADER.pack(magic, version, flags, json_len, weights_len, hashlib.sha256(body + weights).digest())
    assert "invalid" in _load_bytes(tmp_path, header + body + weights)


# ---------------------------------------------------------------- atomic saves
def test_save_into_missing_directory(engine, tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "model.kiln"
    with pytest.raises(kiln.Error) as info:
        engine.save(target)
    assert "model.kiln" in str(info.value)
    assert list(tmp_path.rglob("*")) == []


def test_failed_save_leaves_existing_file_intact(engine, saved, tmp_path, monkeypatch):
    path = tmp_path / "model.kiln"
    path.write_bytes(saved)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(kiln.Error, match="No space left"):
        engine.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.kiln"]
    np.testing.assert_array_equal(kiln.load(path).run({"x": X})["y"], engine.run({"x": X})["y"])


def test_failed_write_midway_leaves_no_temp_file(engine, saved, tmp_path, monkeypatch):
    path = tmp_path / "model.kiln"
    path.write_bytes(saved)

    def boom(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(kiln.Error):
        engine.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.kiln"]


def test_save_over_existing_file(engine, tmp_path):
    path = tmp_path / "model.kiln"
    path.write_bytes(b"old contents")
    engine.save(path)
    assert kiln.load(path).run({"x": X})["y"].shape == (1, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.kiln"]


# ---------------------------------------------------------------- no pickle anywhere
def test_engine_file_is_not_pickle(saved):
    assert not saved.startswith(b"\x80")
    assert saved.startswith(b"KILNPLAN")


def test_kiln_source_never_imports_pickle():
    pattern = re.compile(r"^\s*(import\s+(c?pickle|dill|joblib)\b|from\s+(c?pickle|dill|joblib)\s+import)", re.M)
    offenders = [str(p.relative_to(KILN_SRC)) for p in KILN_SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
    for p in KILN_SRC.rglob("*.py"):
        text = p.read_text()
        assert "torch.load(" not in text and "allow_pickle=True" not in text, p


def test_written_files_get_ordinary_permissions(tmp_path):
    import os
    import stat

    from kiln.fileio import atomic_write_text

    atomic_write_text(tmp_path / "r.json", "{}")
    mode = stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode)
    mask = os.umask(0)
    os.umask(mask)
    assert mode == 0o666 & ~mask


def test_loaded_weights_are_aligned_writable_views_of_one_buffer(engine, saved, tmp_engine):
    """The loader views the weights in the file buffer (no per-tensor copy); the writer aligns the section."""
    _, _, _, json_len, _, _ = HEADER.unpack_from(saved)
    assert (HEADER.size + json_len) % 64 == 0
    engine.save(tmp_engine)
    weights = kiln.load(tmp_engine).plan.weights
    bases = {id(w.base if w.base is not None else w) for w in weights.values()}
    assert len(bases) == 1 and len(weights) > 1
    for name, w in weights.items():
        assert w.flags.writeable and w.ctypes.data % w.dtype.alignment == 0, name
        np.testing.assert_array_equal(w, engine.plan.weights[name])
