"""Any artifact the inspector reads, detected by content: a kiln engine, layer-info JSON, a profile, a times
export, a log with a layer dump or a TensorRT 11.1 tuning cache."""
from __future__ import annotations

from pathlib import Path

from kiln.errors import ArtifactError, Error
from kiln.trt import build_log as log_lines
from kiln.trt.plan_records import engine_info_from_plan
from kiln.trt.profile import profile_lines, read_profile_json, read_times_json
from kiln.trt.readers import read_layer_info_json, read_oneline
from kiln.trt.reading import artifact_error, load_json
from kiln.trt.records import EngineInfo, InferenceTimes, Profile
from kiln.trt.tuning_cache import TuningCache, is_tuning_cache, read_tuning_cache


def read_artifact(path) -> EngineInfo | Profile | InferenceTimes | TuningCache:
    """Read any supported artifact, detected by content."""
    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise artifact_error(where, f"cannot read file ({exc.strerror or exc})", "check the path") from None
    if data.startswith(b"KILNPLAN"):
        from kiln.plan.serialize import plan_from_bytes

        try:
            return engine_info_from_plan(plan_from_bytes(data, where))
        except Error as exc:
            raise artifact_error(where, str(exc).removeprefix(f"{where}: "), "rebuild the engine with `kiln build` "
                                 "(it may be truncated or from a newer kiln)") from None
    if b"\x00" in data:
        raise artifact_error(where, "binary content (not text, not a kiln engine); TensorRT .engine/.plan files "
                                    "cannot be read, export their layer info with trtexec --exportLayerInfo")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise artifact_error(where, "not UTF-8 text") from None
    if not text.strip():
        raise artifact_error(where, "the file is empty")
    return read_text(text, where)


def read_text(text: str, where: str = "<text>") -> EngineInfo | Profile | InferenceTimes | TuningCache:
    """Detect and read an artifact given as text (JSON export, JSON lines or log)."""
    head = text.lstrip()[:1]
    if head == "{" and is_tuning_cache(text):
        return read_tuning_cache(text, where)
    if head == "{":
        return read_layer_info_json(text, where)
    if head == "[" and not log_lines.DATED.match(text.lstrip()):
        try:
            doc = load_json(text, where)
        except ArtifactError:
            if profile_lines(text) is not None:
                return read_profile_json(text, where)
            raise
        if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
            raise artifact_error(where, "a JSON list, but not of records")
        if not doc or any("latencyMs" in r for r in doc[:1]):
            return read_times_json(doc, where)
        if any(set(r) == {"count"} or "name" in r for r in doc[:2]):
            return read_profile_json(doc, where)
        raise artifact_error(where, "JSON records of an unknown kind (neither profile nor times)")
    return read_oneline(text, where)
