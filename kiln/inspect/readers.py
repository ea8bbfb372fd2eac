"""Readers: trtexec and kiln artifacts -> the typed model of `kiln.inspect.model`.

Accepted inputs (TensorRT 7.x - 10.x and kiln's own exports, which use the same formats):

* `--exportLayerInfo` JSON, names-only (`{"Layers": ["a", ...]}`) or detailed (`{"Layers": [{...}]}`), with or
  without Bindings / StreamId / Metadata / Location; every key a LayerRecord has no field for goes to `params`.
* one-line dumps found in logs: the verbose build log's "Engine Layer Information" `Layer(Type): name, Tactic: ...,
  ins -> outs` lines (read as verbosity "layer_names_only": they carry names, types and tensors but no parameters)
  and the inspector's `Name: ..., LayerType: ..., Inputs: [...], ...` lines after a "Layers:" line (verbosity
  "detailed"; plain name lines after "Layers:" read as "layer_names_only"). Other log lines are skipped.
* `--exportProfile` JSON (leading {"count": N}, 4- or 5-key records), `--exportTimes` JSON (TRT 7, 8.0-8.3, 8.4+).
* kiln engine files (b"KILNPLAN"): layers as `kiln.trt.layer_info` describes them, region inner layers with
  `region` set.

Every unreadable input raises `ArtifactError` naming the file, the problem and a hint.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from kiln.errors import ArtifactError, Error
from kiln.inspect.model import (EngineInfo, InferenceTimes, LayerRecord, Profile, ProfileRecord, TensorInfo,
                                origins_from_metadata)

HINT = ("expected trtexec --exportLayerInfo/--exportProfile/--exportTimes JSON, a trtexec log, "
        "or a .kiln engine")
_FIELDS = {"Name", "LayerType", "ParameterType", "Inputs", "Outputs", "TacticName", "TacticValue", "Metadata"}
_TOP_KEYS = {"Layers", "Bindings", "TacticSources"}
_LOG_PREFIX = re.compile(r"^(?:\[\d\d/\d\d/\d{4}-\d\d:\d\d:\d\d\] )?(?:\[[A-Z]\] )?(?:\[TRT\] )?")
_DATED = re.compile(r"^\[\d\d/\d\d/\d{4}-\d\d:\d\d:\d\d\]")
_LAYER_LINE = re.compile(r"^Layer\((?P<type>[^()]*)\): (?P<name>.*?), Tactic: (?P<tactic>[-\w]+),(?P<io>.*)$")
_IO_ITEM = re.compile(r"(?P<name>.*?)(?:\[(?P<dt>\w+)\((?P<d>[-\d,: ]*)\)\]| \((?P<dt2>\w+)\[(?P<d2>[-\d,: ]*)\]\))"
                      r"(?:, |$)")
_TENSOR_ITEM = re.compile(r"\{ Name: (?P<name>.*?)(?:, Location: (?P<loc>[^,]*))?, Dimensions: \[(?P<dims>[-\d, ]*)\]"
                          r", Format/Datatype: (?P<fmt>.*?) \}(?P<sep>, |\])")
_KEY = re.compile(r", ([A-Za-z][\w/]*):(?: |$)")
_TIMES_SETS = (("startInMs", "trt7"), ("endToEndMs", "trt8.0-8.3"), ("startH2dMs", "trt8.4+"))
_PROFILE_LINE = re.compile(r'^\s*,?\s*\{ "name" : "(?P<name>.*)", "timeMs" : (?P<t>[^,]+), "averageMs" : (?P<a>[^,]+)'
                           r'(?:, "medianMs" : (?P<m>[^,]+))?, "percentage" : (?P<p>[^ ]+) \}\s*$')


def _error(where: str, what: str, hint: str = HINT) -> ArtifactError:
    return ArtifactError(f"{where}: {what}; hint: {hint}")


def _load_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, strict=False)   # strict=False: trtexec writes names raw (control characters too)
    except json.JSONDecodeError as exc:
        raise _error(where, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); the file may be "
                            "truncated") from None
    except RecursionError:
        raise _error(where, "JSON nested too deeply") from None


def _as_json(data: Any, where: str) -> Any:
    return _load_json(data, where) if isinstance(data, (str, bytes)) else data


# ---- layer info JSON ---------------------------------------------------------------------------------------------

def read_layer_info_json(text: str | dict, where: str = "<layer info>") -> EngineInfo:
    """trtexec --exportLayerInfo JSON (text or an already-parsed dict) -> EngineInfo."""
    doc = _as_json(text, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("Layers"), list):
        raise _error(where, "not a layer-info document (no \"Layers\" list)",
                     "expected the output of trtexec --exportLayerInfo (or kiln build --export-layer-info)")
    raw, notes = doc["Layers"], []
    if all(isinstance(x, str) for x in raw):
        layers, verbosity = tuple(LayerRecord(name=x) for x in raw), "layer_names_only"
    else:
        layers = tuple(_layer_from_dict(x, where, i) for i, x in enumerate(raw))
        verbosity = "detailed"
    bindings = doc.get("Bindings", [])
    if not isinstance(bindings, list) or not all(isinstance(b, str) for b in bindings):
        raise _error(where, "\"Bindings\" is not a list of tensor names", "the file may have been edited by hand")
    extra = sorted(set(doc) - _TOP_KEYS)
    if extra:
        notes.append("unknown top-level keys ignored: " + ", ".join(extra))
    sources = doc.get("TacticSources")
    if isinstance(sources, dict):
        notes.append("kiln tactic sources: " + "; ".join(f"{k}={','.join(map(str, v))}" for k, v in sources.items()
                                                         if isinstance(v, list)))
    return EngineInfo("trtexec-json", verbosity, layers, tuple(bindings), notes=tuple(notes))


def _tensor_from_dict(t: Any, where: str, layer: str) -> TensorInfo:
    if isinstance(t, str):
        return TensorInfo(t)
    if not isinstance(t, dict) or not isinstance(t.get("Name"), str):
        raise _error(where, f"layer '{layer}' has a tensor entry without a \"Name\"", "the file may be damaged")
    dims = t.get("Dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        dims = tuple(dims)
    else:
        dims = None
    fmt = t.get("Format/Datatype")
    return TensorInfo(t["Name"], dims, fmt if isinstance(fmt, str) else None, t.get("Location"))


def _layer_from_dict(d: Any, where: str, index: int) -> LayerRecord:
    if isinstance(d, str):
        return LayerRecord(name=d)
    if not isinstance(d, dict) or not isinstance(d.get("Name"), str):
        raise _error(where, f"layer #{index} is neither a name nor an object with a \"Name\"",
                     "the file may be damaged or not a layer-info export")
    name = d["Name"]
    tensors = {}
    for key in ("Inputs", "Outputs"):
        items = d.get(key) or []
        if not isinstance(items, list):
            raise _error(where, f"layer '{name}': \"{key}\" is not a list", "the file may be damaged")
        tensors[key] = tuple(_tensor_from_dict(t, where, name) for t in items)
    tactic = d.get("TacticValue")
    if isinstance(tactic, int):
        tactic = f"0x{tactic:016x}"
    metadata = d.get("Metadata")
    return LayerRecord(name=name, layer_type=_str(d.get("LayerType")), parameter_type=_str(d.get("ParameterType")),
                       inputs=tensors["Inputs"], outputs=tensors["Outputs"],
                       params={k: v for k, v in d.items() if k not in _FIELDS},
                       tactic_name=_str(d.get("TacticName")), tactic_value=_str(tactic),
                       origin=origins_from_metadata(metadata if isinstance(metadata, str) else None))


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


# ---- one-line dumps in logs --------------------------------------------------------------------------------------

def read_oneline(text: str, where: str = "<log>", dump: str = "auto") -> EngineInfo:
    """Layer dumps in a log. `dump`: "layers" (the inspector's "Layers:" block), "engine" (the verbose build log's
    "Engine Layer Information" Layer(...) lines) or "auto" (the Layers block when present, else the engine dump)."""
    names, details, engine, bindings, notes = [], [], [], [], []
    section = None
    for n, raw in enumerate(text.split("\n"), 1):
        line = _LOG_PREFIX.sub("", raw, count=1).rstrip("\r")
        dated = bool(_DATED.match(raw))
        if line.strip() in ("Layers:", "Bindings:"):
            section = line.strip()
            continue
        if line.startswith("Layer(") and (m := _LAYER_LINE.match(line)):
            engine.append(_engine_layer(m, where, n, notes))
        elif line.startswith("Name: "):
            layer = _name_block(line, n, notes)
            if layer is not None:
                details.append(layer)
        elif section and not dated and line.strip():
            (names if section == "Layers:" else bindings).append(line.strip())
        elif dated or not line.strip():
            section = None
    notes += [f"{len(engine)} Layer(...) lines also present"] if engine and (details or names) else []
    if dump not in ("auto", "layers", "engine"):
        raise Error(f"unknown dump '{dump}'; use auto, layers or engine")
    if dump != "engine" and (details or names):
        verbosity = "detailed" if details else "layer_names_only"
        layers = tuple(details) if details else tuple(LayerRecord(name=x) for x in names)
        return EngineInfo("trtexec-oneline", verbosity, layers, tuple(bindings), notes=tuple(notes))
    if dump != "layers" and engine:
        return EngineInfo("trtexec-oneline", "layer_names_only", tuple(engine), tuple(bindings), notes=tuple(notes))
    raise _error(where, "no layer dump found (no \"Layer(...)\" or \"Name: ..., LayerType: ...\" lines)",
                 HINT + " (build with --verbose, or run trtexec with --dumpLayerInfo)")


def _engine_layer(m: re.Match, where: str, n: int, notes: list[str]) -> LayerRecord:
    """`Layer(Type): name, Tactic: 0x..., in[Float(1,3)] -> out[Int8(1,3)]` (TRT 8); `in (Half[1,40])` (TRT 10)."""
    io = m["io"].strip()
    if io.startswith("->"):
        ins, outs = "", io[2:].strip()
    else:
        cut = [k.start() for k in re.finditer(" -> ", io) if io[k.start() - 1] in ")]"]
        if not cut:
            notes.append(f"line {n}: could not split the tensors of '{m['name']}'")
            ins, outs = "", ""
        else:
            ins, outs = io[:cut[0]], io[cut[0] + 4:]
    return LayerRecord(name=m["name"], layer_type=m["type"], inputs=_io_tensors(ins, n, notes),
                       outputs=_io_tensors(outs, n, notes), tactic_value=m["tactic"])


def _io_tensors(text: str, n: int, notes: list[str]) -> tuple[TensorInfo, ...]:
    out, pos = [], 0
    while pos < len(text):
        m = _IO_ITEM.match(text, pos)
        if m is None or m.end() == pos:
            notes.append(f"line {n}: unreadable tensor list at '{text[pos:pos + 40]}'")
            break
        dtype, dims = (m["dt"], m["d"]) if m["dt"] else (m["dt2"], m["d2"])
        out.append(TensorInfo(m["name"], _dims(dims), dtype))
        pos = m.end()
    return tuple(out)


def _dims(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split(",")) if text.strip() else ()
    except ValueError:      # vectorized notation such as "1:4"
        return None


def _tensor_list(line: str, pos: int) -> tuple[tuple[TensorInfo, ...], int] | None:
    """Parse `[ { Name: ..., Dimensions: [...], Format/Datatype: ... }, ...]` at pos; returns tensors and end."""
    if line.startswith("[]", pos):
        return (), pos + 2
    if not line.startswith("[ ", pos):
        return None
    pos, tensors = pos + 2, []
    while True:
        m = _TENSOR_ITEM.match(line, pos)
        if m is None:
            return None
        tensors.append(TensorInfo(m["name"], _dims(m["dims"]), m["fmt"], m["loc"]))
        pos = m.end()
        if m["sep"] == "]":
            return tuple(tensors), pos
        pos = _skip_space(line, pos)


def _skip_space(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] == " ":
        pos += 1
    return pos


def _name_block(line: str, n: int, notes: list[str]) -> LayerRecord | None:
    """`Name: n, LayerType: t, Inputs: [...], Outputs: [...], Key: value, ..., Metadata: ...` -> LayerRecord."""
    head = re.match(r"Name: (?P<name>.*?), LayerType: (?P<type>[^,]*), Inputs: ", line)
    ins = head and _tensor_list(line, head.end())
    if not ins or not line.startswith(", Outputs: ", ins[1]):
        notes.append(f"line {n}: unreadable layer line skipped ('{line[:60]}...')")
        return None
    outs = _tensor_list(line, ins[1] + len(", Outputs: "))
    if outs is None:
        notes.append(f"line {n}: unreadable outputs of '{head['name']}' skipped")
        return None
    d = _key_values(line[outs[1]:])
    metadata = d.pop("Metadata", None)
    return LayerRecord(name=head["name"], layer_type=head["type"], parameter_type=_str(d.pop("ParameterType", None)),
                       inputs=ins[0], outputs=outs[0], tactic_name=_str(d.pop("TacticName", None)),
                       tactic_value=_str(d.pop("TacticValue", None)), params=d,
                       origin=origins_from_metadata(metadata if isinstance(metadata, str) else None))


def _key_values(rest: str) -> dict[str, Any]:
    """`, Kernel: [3,3], Weights: {"Type": "Int8", "Count": 864}, Metadata: ...` -> dict (split at bracket depth 0;
    Metadata, always last, takes the rest of the line)."""
    cuts, depth, k = [], 0, 0
    for m in _KEY.finditer(rest):
        depth += sum(rest.count(c, k, m.start()) for c in "[{(") - sum(rest.count(c, k, m.start()) for c in "]})")
        k = m.start()
        if depth <= 0 and (not cuts or cuts[-1][0] != "Metadata"):
            cuts.append((m[1], m.start(), m.end()))
    out: dict[str, Any] = {}
    for i, (key, _, end) in enumerate(cuts):
        value = rest[end:cuts[i + 1][1]] if i + 1 < len(cuts) else rest[end:]
        out[key] = _value(value.strip() if key != "Metadata" else value.strip(" "))
    return out


def _value(text: str) -> Any:
    if text and text[0] in "[{-0123456789":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


# ---- profile and times -------------------------------------------------------------------------------------------

def read_profile_json(text: str, where: str = "<profile>") -> Profile:
    """trtexec --exportProfile: `[{"count": N}, {"name", "timeMs", "averageMs", ["medianMs",] "percentage"}, ...]`."""
    try:
        doc = _as_json(text, where)
    except ArtifactError:
        doc = _profile_lines(text) if isinstance(text, str) else None   # names written raw (unescaped quotes)
        if doc is None:
            raise
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise _error(where, "not a profile (expected a JSON list of records)",
                     "expected the output of trtexec --exportProfile")
    count, records = None, []
    for i, r in enumerate(doc):
        if set(r) == {"count"}:
            count = _number(r["count"], where, i, int)
            continue
        if not {"name", "timeMs", "averageMs", "percentage"} <= set(r):
            raise _error(where, f"profile record #{i} lacks name/timeMs/averageMs/percentage",
                         "expected the output of trtexec --exportProfile")
        median = r.get("medianMs")
        records.append(ProfileRecord(str(r["name"]), _number(r["timeMs"], where, i), _number(r["averageMs"], where, i),
                                     None if median is None else _number(median, where, i),
                                     _number(r["percentage"], where, i)))
    return Profile(count, tuple(records))


def _profile_lines(text: str) -> list[dict] | None:
    """Line-by-line reading of a profile whose layer names broke JSON (trtexec does not escape them)."""
    rows: list[dict] = []
    for line in text.split("\n"):
        s = line.strip()
        if s in ("[", "]", ""):
            continue
        if (m := re.match(r'^\{ "count" : (\d+) \}$', s)):
            rows.append({"count": int(m[1])})
        elif (m := _PROFILE_LINE.match(line)):
            row = {"name": m["name"], "timeMs": m["t"], "averageMs": m["a"], "percentage": m["p"]}
            rows.append(row | ({"medianMs": m["m"]} if m["m"] else {}))
        else:
            return None
    return rows if rows and text.rstrip().endswith("]") else None


def _number(v: Any, where: str, i: int, kind=float):
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise _error(where, f"record #{i}: '{v}' is not a number", "the file may be damaged") from None


def read_times_json(text: str, where: str = "<times>") -> InferenceTimes:
    """trtexec --exportTimes: one record per inference; key sets of TRT 8.4+ (12 keys), 8.0-8.3 (+endToEndMs), 7.x
    (startInMs ...). An empty list reads as an empty 8.4+ set."""
    doc = _as_json(text, where)
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise _error(where, "not a times export (expected a JSON list of records)",
                     "expected the output of trtexec --exportTimes")
    key_set = "trt8.4+"
    if doc:
        key_set = next((name for key, name in _TIMES_SETS if key in doc[0]), None)
        if key_set is None or not all({"latencyMs", "computeMs"} <= set(r) for r in doc):
            raise _error(where, "records lack latencyMs/computeMs (or the start*Ms keys of a known TensorRT version)",
                         "expected the output of trtexec --exportTimes")
    return InferenceTimes(tuple(_number(r["latencyMs"], where, i) for i, r in enumerate(doc)),
                          tuple(_number(r["computeMs"], where, i) for i, r in enumerate(doc)), key_set)


# ---- auto-detection ----------------------------------------------------------------------------------------------

def engine_info_from_plan(plan, where: str = "<engine>") -> EngineInfo:
    """A kiln plan as layer info: `layer_info(plan, "detailed")`, region inner layers tagged with their region."""
    from kiln.trt.layer_info import layer_info

    info = read_layer_info_json(layer_info(plan, "detailed"), where)
    regions = [l.name if l.inner else None for l in plan.layers for _ in (l.inner or (l,))]
    layers = tuple(dataclasses.replace(rec, region=r) if r else rec for rec, r in zip(info.layers, regions))
    return dataclasses.replace(info, source="kiln-engine", layers=layers)


def read_artifact(path) -> EngineInfo | Profile | InferenceTimes:
    """Read any supported artifact, detected by content."""
    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _error(where, f"cannot read file ({exc.strerror or exc})", "check the path") from None
    if data.startswith(b"KILNPLAN"):
        from kiln.plan.serialize import plan_from_bytes

        try:
            return engine_info_from_plan(plan_from_bytes(data, where), where)
        except Error as exc:
            raise _error(where, str(exc).removeprefix(f"{where}: "),
                         "rebuild the engine with `kiln build` (it may be truncated or from a newer kiln)") from None
    if b"\x00" in data:
        raise _error(where, "binary content (not text, not a kiln engine); TensorRT .engine/.plan files cannot be "
                            "read, export their layer info with trtexec --exportLayerInfo")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _error(where, "not UTF-8 text") from None
    if not text.strip():
        raise _error(where, "the file is empty")
    return read_text(text, where)


def read_text(text: str, where: str = "<text>") -> EngineInfo | Profile | InferenceTimes:
    """Detect and read an artifact given as text (JSON export or log)."""
    head = text.lstrip()[:1]
    if head == "{":
        return read_layer_info_json(text, where)
    if head == "[" and not _DATED.match(text.lstrip()):
        try:
            doc = _load_json(text, where)
        except ArtifactError:
            if _profile_lines(text) is not None:
                return read_profile_json(text, where)
            raise
        if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
            raise _error(where, "a JSON list, but not of records")
        if not doc or any("latencyMs" in r for r in doc[:1]):
            return read_times_json(doc, where)
        if any(set(r) == {"count"} or "name" in r for r in doc[:2]):
            return read_profile_json(doc, where)
        raise _error(where, "JSON records of an unknown kind (neither profile nor times)")
    return read_oneline(text, where)
