"""What TensorRT 11 changed in the engine inspector's JSON, read into the same records as 10.x (so every command
reports the same layers, precisions and I/O for both schemas):

* `"I/O Tensors"` (objects: Name, IOMode, DataType, Dimensions, Location, IsShapeInferenceIO, ProfileInfo with
  MinShape/OptShape/MaxShape and Format) instead of `"Bindings"` (names); the names become `EngineInfo.bindings`,
  the objects `EngineInfo.io_tensors`;
* each layer tensor's `"Format/Datatype"` prose split into `"Format"` and `"Datatype"` (also read as "DataType");
  the precision comes from the data type, the format's " (kLINEAR)" enum is split off its prose;
* top-level `"ProfilingVerbosity"` and `"Engine Metadata"`.

Bad input raises `ArtifactError` naming the file, the tensor and the field."""
from __future__ import annotations

from typing import Any

from kiln.trt.reading import artifact_error
from kiln.trt.records import IOTensor, ProfileShapes, TensorInfo
from kiln.trt.vocab import DATATYPE_NAMES, datatype_precision, profiling_verbosity, split_format_enum

IO_TENSORS, VERBOSITY_KEY, METADATA_KEY = "I/O Tensors", "ProfilingVerbosity", "Engine Metadata"
TOP_KEYS = {IO_TENSORS, VERBOSITY_KEY, METADATA_KEY}
_DAMAGED = "the file may be damaged or edited by hand"


def is_trt11_tensor(t: dict[str, Any]) -> bool:
    """A layer tensor in TensorRT 11's form (separate "Format" / "Datatype" fields)."""
    return "Format/Datatype" not in t and any(k in t for k in ("Format", "Datatype", "DataType"))


def precision_field(d: dict[str, Any], where: str, what: str) -> str | None:
    """The precision a tensor's "Datatype" / "DataType" names; None when absent or "N/A"; an error when unknown."""
    key = "Datatype" if "Datatype" in d else "DataType"
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise artifact_error(where, f"{what}: \"{key}\" is {value!r}, not a data type name", _DAMAGED)
    try:
        return datatype_precision(value)
    except ValueError:
        raise artifact_error(where, f"{what}: unknown \"{key}\" '{value}' (TensorRT's data types: "
                                    f"{', '.join(DATATYPE_NAMES)})", _DAMAGED) from None


def tensor_11(t: dict[str, Any], where: str, layer: str, dims: tuple[int, ...] | None) -> TensorInfo:
    """A layer's tensor in TensorRT 11's form -> TensorInfo (format prose without its enum, precision from the type)."""
    what = f"layer '{layer}', tensor '{t['Name']}'"
    precision = precision_field(t, where, what)
    fmt = t.get("Format")
    if fmt is not None and not isinstance(fmt, str):
        raise artifact_error(where, f"{what}: \"Format\" is {fmt!r}, not text", _DAMAGED)
    text = split_format_enum(fmt)[0] if fmt else None
    return TensorInfo(t["Name"], dims, text, t.get("Location"), precision=precision)


def io_tensors(doc: dict[str, Any], where: str) -> tuple[IOTensor, ...]:
    """The "I/O Tensors" list (absent: none)."""
    items = doc.get(IO_TENSORS, [])
    if not isinstance(items, list):
        raise artifact_error(where, f"\"{IO_TENSORS}\" is not a list", _DAMAGED)
    return tuple(_io_tensor(x, where, i) for i, x in enumerate(items))


def _io_tensor(d: Any, where: str, index: int) -> IOTensor:
    if not isinstance(d, dict) or not isinstance(d.get("Name"), str) or not d["Name"]:
        raise artifact_error(where, f"\"{IO_TENSORS}\" entry #{index} has no \"Name\"",
                             "every I/O tensor needs its name; " + _DAMAGED)
    name = d["Name"]
    what = f"I/O tensor '{name}'"
    mode = d.get("IOMode")
    if mode is not None and str(mode).lower().removeprefix("k") not in ("input", "output", "none"):
        raise artifact_error(where, f"{what}: unknown \"IOMode\" '{mode}' (expected Input or Output)", _DAMAGED)
    profiles = d.get("ProfileInfo") or []
    if not isinstance(profiles, list) or not all(isinstance(p, dict) for p in profiles):
        raise artifact_error(where, f"{what}: \"ProfileInfo\" is not a list of objects", _DAMAGED)
    data_type = d.get("DataType", d.get("Datatype"))
    return IOTensor(name=name, io_mode=None if mode is None else str(mode),
                    data_type=None if data_type is None else str(data_type),
                    precision=precision_field(d, where, what), dims=dims_field(d, "Dimensions", where, what),
                    location=d.get("Location"), shape_inference_io=bool(d.get("IsShapeInferenceIO", False)),
                    profiles=tuple(_profile(p, where, f"{what}, profile {k}") for k, p in enumerate(profiles)))


def _profile(p: dict[str, Any], where: str, what: str) -> ProfileShapes:
    fmt = p.get("Format")
    return ProfileShapes(dims_field(p, "MinShape", where, what), dims_field(p, "OptShape", where, what),
                         dims_field(p, "MaxShape", where, what),
                         split_format_enum(fmt)[0] if isinstance(fmt, str) else None)


def dims_field(d: dict[str, Any], key: str, where: str, what: str) -> tuple[int, ...] | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise artifact_error(where, f"{what}: \"{key}\" is {value!r}, not a list of integers", _DAMAGED)
    return tuple(value)


def declared_verbosity(doc: dict[str, Any], where: str) -> str | None:
    """Top-level "ProfilingVerbosity" as kiln's verbosity name ("detailed", ...); None when absent."""
    value = doc.get(VERBOSITY_KEY)
    if value is None:
        return None
    verbosity = profiling_verbosity(value) if isinstance(value, str) else None
    if verbosity is None:
        raise artifact_error(where, f"unknown \"{VERBOSITY_KEY}\" {value!r} (expected DETAILED, LAYER_NAMES_ONLY or "
                                    "NONE)", _DAMAGED)
    return verbosity


def engine_metadata(doc: dict[str, Any], where: str) -> dict[str, Any]:
    value = doc.get(METADATA_KEY, {})
    if not isinstance(value, dict):
        raise artifact_error(where, f"\"{METADATA_KEY}\" is not an object", _DAMAGED)
    return value
