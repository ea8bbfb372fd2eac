"""Readers of TensorRT's layer descriptions (TensorRT 7.x - 11.x and kiln's own exports, which use the same
formats) into the records of `kiln.trt.records`:

* `--exportLayerInfo` JSON, names-only (`{"Layers": ["a", ...]}`) or detailed (`{"Layers": [{...}]}`), with or
  without Bindings / StreamId / Metadata / Location; every key a LayerRecord has no field for goes to `params`.
  TensorRT 11's schema (I/O Tensors, separate Format and Datatype, ProfilingVerbosity, Engine Metadata) is read into
  the same records by `kiln.trt.readers_trt11`.
* one-line dumps found in logs: the verbose build log's "Engine Layer Information" `Layer(Type): name, Tactic: ...,
  ins -> outs` lines (read as verbosity "layer_names_only": they carry names, types and tensors but no parameters;
  their format is in `kiln.trt.build_log`, beside kiln's writer) and the inspector's `Name: ..., LayerType: ...,
  Inputs: [...], ...` lines after a "Layers:" line (verbosity "detailed"; plain name lines after "Layers:" read as
  "layer_names_only"). Other log lines are skipped.

Profiles and times are read by `kiln.trt.profile`, kiln engines by `kiln.trt.plan_records`, any of them by content
by `kiln.trt.artifacts.read_artifact`. Every unreadable input raises `ArtifactError` naming the file, the problem
and a hint.
"""
from __future__ import annotations

import json
import re
from typing import Any

from kiln.errors import Error
from kiln.trt import build_log as log_lines
from kiln.trt import readers_trt11 as trt11
from kiln.trt.reading import HINT, artifact_error, as_json
from kiln.trt.vocab import origins_from_metadata
from kiln.trt.records import EngineInfo, LayerRecord, TensorInfo

# layer-info keys a LayerRecord has a field for; every other key goes to `params`
LAYER_FIELDS = {"Name", "LayerType", "ParameterType", "Inputs", "Outputs", "TacticName", "TacticValue", "Metadata"}
_TOP_KEYS = {"Layers", "Bindings", "TacticSources"} | trt11.TOP_KEYS
# layer_info.oneline's lines: `Name: n, LayerType: t, Inputs: [ { Name: ..., Format/Datatype: ... }], ...`
# (TensorRT 11: `..., Format: ..., Datatype: ... }`)
_ONELINE_HEAD = re.compile(r"Name: (?P<name>.*?), LayerType: (?P<type>[^,]*), Inputs: ")
_TENSOR_ITEM = re.compile(r"\{ Name: (?P<name>.*?)(?:, Location: (?P<loc>[^,]*))?, Dimensions: \[(?P<dims>[-\d, ]*)\]"
                          r"(?:, Format/Datatype: (?P<fmt>.*?)|, Format: (?P<fmt11>.*?), Datatype: (?P<dt>[^,{}]*?))"
                          r" \}(?P<sep>, |\])")
_KEY = re.compile(r", ([A-Za-z][\w/]*):(?: |$)")


# ---- layer info JSON ---------------------------------------------------------------------------------------------

def read_layer_info_json(text: str | dict, where: str = "<layer info>") -> EngineInfo:
    """trtexec --exportLayerInfo JSON (text or an already-parsed dict) -> EngineInfo."""
    doc = as_json(text, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("Layers"), list):
        raise artifact_error(where, "not a layer-info document (no \"Layers\" list)",
                             "expected the output of trtexec --exportLayerInfo (or kiln build --export-layer-info)")
    raw, notes = doc["Layers"], []
    if all(isinstance(x, str) for x in raw):
        layers, verbosity = tuple(LayerRecord(name=x) for x in raw), "layer_names_only"
    else:
        layers = tuple(_layer_from_dict(x, where, i) for i, x in enumerate(raw))
        verbosity = "detailed"
    declared = trt11.declared_verbosity(doc, where)
    if declared is not None and raw and declared != verbosity:
        notes.append(f"\"ProfilingVerbosity\" says {declared}, but the layers read as {verbosity}")
    verbosity = declared if declared is not None and not raw else verbosity
    bindings, io = _bindings(doc, where, notes)
    extra = sorted(set(doc) - _TOP_KEYS)
    if extra:
        notes.append("unknown top-level keys ignored: " + ", ".join(extra))
    sources = doc.get("TacticSources")
    if isinstance(sources, dict):
        notes.append(tactic_sources_note(sources))
    return EngineInfo("trtexec-json", verbosity, layers, bindings, notes=tuple(notes), io_tensors=io,
                      metadata=trt11.engine_metadata(doc, where))


def _bindings(doc: dict[str, Any], where: str, notes: list[str]) -> tuple[tuple[str, ...], tuple]:
    """The engine's I/O: 10.x "Bindings" (names) or 11.x "I/O Tensors" (objects, named in the same order)."""
    bindings = doc.get("Bindings", [])
    if not isinstance(bindings, list) or not all(isinstance(b, str) for b in bindings):
        raise artifact_error(where, "\"Bindings\" is not a list of tensor names",
                             "the file may have been edited by hand")
    io = trt11.io_tensors(doc, where)
    if io and bindings and [t.name for t in io] != bindings:
        notes.append("\"Bindings\" and \"I/O Tensors\" name different tensors; the I/O Tensors are used")
    return (tuple(t.name for t in io) if io else tuple(bindings)), io


def tactic_sources_note(sources: dict[str, Any]) -> str:
    """kiln's "TacticSources" (Available / Enabled / Used lists) as one note."""
    return "kiln tactic sources: " + "; ".join(f"{k}={','.join(map(str, v))}" for k, v in sources.items()
                                               if isinstance(v, list))


def _tensor_from_dict(t: Any, where: str, layer: str) -> TensorInfo:
    if isinstance(t, str):
        return TensorInfo(t)
    if not isinstance(t, dict) or not isinstance(t.get("Name"), str):
        raise artifact_error(where, f"layer '{layer}' has a tensor entry without a \"Name\"",
                             "the file may be damaged")
    dims = t.get("Dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        dims = tuple(dims)
    else:
        dims = None
    if trt11.is_trt11_tensor(t):
        return trt11.tensor_11(t, where, layer, dims)
    fmt = t.get("Format/Datatype")
    return TensorInfo(t["Name"], dims, fmt if isinstance(fmt, str) else None, t.get("Location"))


def _layer_from_dict(d: Any, where: str, index: int) -> LayerRecord:
    if isinstance(d, str):
        return LayerRecord(name=d)
    if not isinstance(d, dict) or not isinstance(d.get("Name"), str):
        raise artifact_error(where, f"layer #{index} is neither a name nor an object with a \"Name\"",
                             "the file may be damaged or not a layer-info export")
    name = d["Name"]
    tensors = {}
    for key in ("Inputs", "Outputs"):
        items = d.get(key) or []
        if not isinstance(items, list):
            raise artifact_error(where, f"layer '{name}': \"{key}\" is not a list", "the file may be damaged")
        tensors[key] = tuple(_tensor_from_dict(t, where, name) for t in items)
    tactic = d.get("TacticValue")
    if isinstance(tactic, int):
        tactic = f"0x{tactic:016x}"
    metadata = d.get("Metadata")
    return LayerRecord(name=name, layer_type=_str(d.get("LayerType")), parameter_type=_str(d.get("ParameterType")),
                       inputs=tensors["Inputs"], outputs=tensors["Outputs"],
                       params={k: v for k, v in d.items() if k not in LAYER_FIELDS},
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
        line = log_lines.LOG_PREFIX.sub("", raw, count=1).rstrip("\r")
        dated = bool(log_lines.DATED.match(raw))
        if line.strip() in ("Layers:", "Bindings:"):
            section = line.strip()
            continue
        if line.startswith("Layer(") and (m := log_lines.ENGINE_LAYER_FIELDS.match(line)):
            engine.append(_engine_layer(m, where, n, notes))
        elif line.startswith("Name: "):
            layer = _name_block(line, n, notes, where)
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
    raise artifact_error(where, "no layer dump found (no \"Layer(...)\" or \"Name: ..., LayerType: ...\" lines)",
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
        m = log_lines.ENGINE_LAYER_TENSOR.match(text, pos)
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


def _tensor_list(line: str, pos: int, where: str, layer: str) -> tuple[tuple[TensorInfo, ...], int] | None:
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
        if m["dt"] is not None:
            d = {"Name": m["name"], "Location": m["loc"], "Format": m["fmt11"], "Datatype": m["dt"]}
            tensors.append(trt11.tensor_11(d, where, layer, _dims(m["dims"])))
        else:
            tensors.append(TensorInfo(m["name"], _dims(m["dims"]), m["fmt"], m["loc"]))
        pos = m.end()
        if m["sep"] == "]":
            return tuple(tensors), pos
        pos = _skip_space(line, pos)


def _skip_space(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] == " ":
        pos += 1
    return pos


def _name_block(line: str, n: int, notes: list[str], where: str) -> LayerRecord | None:
    """`Name: n, LayerType: t, Inputs: [...], Outputs: [...], Key: value, ..., Metadata: ...` -> LayerRecord."""
    head = _ONELINE_HEAD.match(line)
    ins = head and _tensor_list(line, head.end(), f"{where}:{n}", head["name"])
    if not ins or not line.startswith(", Outputs: ", ins[1]):
        notes.append(f"line {n}: unreadable layer line skipped ('{line[:60]}...')")
        return None
    outs = _tensor_list(line, ins[1] + len(", Outputs: "), f"{where}:{n}", head["name"])
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
