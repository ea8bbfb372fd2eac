"""Google Model Explorer's files for an engine description (`kiln.trt.records.EngineInfo`): the graph JSON its
JSON adapter loads (a GraphCollection: one node per layer, namespaces from the layer's ONNX node names, edges from
tensors, "GraphInputs"/"GraphOutputs" nodes as Model Explorer's own adapters make them) and node-data overlays keyed
by graph id (precision and tactic as labels, latency as a gradient). Plain JSON: Model Explorer is needed only to
look at it. The schemas are `model_explorer.graph_builder` and `model_explorer.node_data_builder`."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import Error
from kiln.fileio import atomic_write_text
from kiln.inspect.lint import is_qdq
from kiln.inspect.render import PRECISION_COLOURS, truncate
from kiln.trt.records import EngineInfo, LayerRecord, Profile, TensorInfo, is_reformat

GRAPH_FILE = "graph.json"
PRECISION_FILE = "precision.json"
TACTIC_FILE = "tactic.json"
LATENCY_FILE = "latency.json"
INPUTS_NODE = "GraphInputs"          # id, label and namespace, as Model Explorer's TFLite/TOSA adapters name them
OUTPUTS_NODE = "GraphOutputs"
TENSOR_TAG = "__tensor_tag"          # the metadata key Model Explorer shows as a tensor's name
MAX_LABEL_CHARS = 48
MAX_ATTR_CHARS = 2000                # longer parameter values are cut (a side panel is not a file viewer)
# kernel families get these colours in the tactic overlay, in order of first appearance
FAMILY_PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
                  "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")
LATENCY_GRADIENT = ({"stop": 0, "bgColor": "#fff5f0"}, {"stop": 0.5, "bgColor": "#fc9272"},
                    {"stop": 1, "bgColor": "#cb181d"})
UNSIGNED_AS = {"UINT8": "INT8"}      # onnxruntime's default asymmetric activations: coloured as INT8
_PWN = re.compile(r"PWN\(|\)")
_FOREIGN = re.compile(r"^\{ForeignNode\[(?P<first>.*)\.\.\.(?P<last>.*)\]\}$")
_REFORMAT_TARGET = re.compile(r"^Reformatting CopyNode for (?:Input|Output) Tensor \d+ to (?P<layer>.*)$")


@dataclass(frozen=True)
class ExplorerFiles:
    """What `write_model_explorer` wrote: the graph and the overlays (precision, tactic, latency when timed)."""

    graph: Path
    overlays: tuple[Path, ...]
    removed: tuple[Path, ...] = ()   # stale overlays of an earlier export that this one has no data for

    def command(self) -> str:
        """The command that opens them in Model Explorer."""
        cmd = f"model-explorer {self.graph}"
        return cmd + (f" --node_data_paths={','.join(str(p) for p in self.overlays)}" if self.overlays else "")


# ---- ONNX nodes and namespaces -----------------------------------------------------------------------------------

def onnx_nodes(layer: LayerRecord) -> tuple[str, ...]:
    """The ONNX nodes a layer computes: its origins (kiln, or TensorRT's `[ONNX Layer: ...]` Metadata), else read
    from its name ("a + b", "a || b", "PWN(PWN(a), b)", "{ForeignNode[first...last]}" gives its two ends).
    Reformat layers compute none."""
    if layer.origin:
        return layer.origin
    if is_reformat(layer) or layer.name.startswith("(Unnamed Layer"):
        return ()
    foreign = _FOREIGN.match(layer.name)
    if foreign:
        return (foreign["first"], foreign["last"])
    names = []
    for part in layer.fused_names:
        names += [p.strip() for p in _PWN.sub("", part).split(", ")] if part.startswith("PWN(") else [part]
    return tuple(n for n in names if n)


def module_path(names: tuple[str, ...]) -> tuple[str, ...]:
    """The module path the ONNX node names with a path share: ("/block/c1/Conv", "/block/Relu") -> ("block",).
    Names without one (TensorRT's "resnetv15_conv0_fwd") do not count, nor Q/DQ nodes beside other nodes: they
    are named after the tensor they quantize, which a neighbouring module produced."""
    compute = [n for n in names if not is_qdq(LayerRecord(n))] or list(names)
    paths = [tuple(s for s in n.split("/")[:-1] if s) for n in compute if "/" in n]
    if not paths:
        return ()
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return common


def namespaces(engine: EngineInfo) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Each layer's namespace (its region's group, then the module path of its ONNX nodes; a Reformat layer takes
    the namespace of the layer it feeds) and the group attributes Model Explorer shows for region groups."""
    regions = {r: f"ForeignNode_{n}" for n, r in enumerate(dict.fromkeys(l.region for l in engine.layers if l.region))}
    by_name = {layer.name: layer for layer in engine.layers}
    out = []
    for layer in engine.layers:
        target = _REFORMAT_TARGET.match(layer.name)
        source = by_name.get(target["layer"], layer) if target else layer
        path = module_path(onnx_nodes(source))
        if layer.region:
            path = (regions[layer.region],) + path
        out.append("/".join(_segment(s) for s in path))
    groups = {group: {"region": region, "layers": str(sum(l.region == region for l in engine.layers))}
              for region, group in regions.items()}
    return out, groups


def _segment(text: str) -> str:
    return text.replace("\n", " ").strip() or "_"


# ---- the graph ---------------------------------------------------------------------------------------------------

def node_ids(engine: EngineInfo) -> list[str]:
    """One id per layer: its name (unique in TensorRT's and kiln's files), "#2", "#3", ... appended to repeats."""
    taken, ids = {INPUTS_NODE, OUTPUTS_NODE}, []
    for layer in engine.layers:
        node_id, n = layer.name, 1
        while node_id in taken:
            n += 1
            node_id = f"{layer.name} #{n}"
        taken.add(node_id)
        ids.append(node_id)
    return ids


def has_tensors(engine: EngineInfo) -> bool:
    return any(layer.inputs or layer.outputs for layer in engine.layers)


def _kv(key: str, value: Any) -> dict[str, str]:
    text = value if isinstance(value, str) else json.dumps(value)
    return {"key": key, "value": text if len(text) <= MAX_ATTR_CHARS else text[:MAX_ATTR_CHARS - 1] + "…"}


def _dims(t: TensorInfo) -> str:
    return "x".join(str(d) for d in t.dims) if t.dims is not None else "?"


def _tensor_metadata(tensors: tuple[TensorInfo, ...]) -> list[dict[str, Any]]:
    items = []
    for i, t in enumerate(tensors):
        attrs = [_kv(TENSOR_TAG, t.name), _kv("shape", _dims(t))]
        attrs += [_kv(k, v) for k, v in (("format", t.format), ("precision", t.precision), ("location", t.location))
                  if v]
        items.append({"id": str(i), "attrs": attrs})
    return items


def layer_attrs(layer: LayerRecord, avg_ms: float | None) -> list[dict[str, str]]:
    """The side panel of a layer: name, type, precision, tactic, ONNX nodes, shapes, formats, time, parameters."""
    pairs: list[tuple[str, Any]] = [
        ("name", layer.name), ("layer_type", layer.layer_type), ("parameter_type", layer.parameter_type),
        ("precision", layer.precision), ("tactic", layer.tactic_name), ("tactic_value", layer.tactic_value),
        ("onnx_nodes", "\n".join(onnx_nodes(layer))), ("region", layer.region),
        ("input_shapes", "; ".join(_dims(t) for t in layer.inputs)),
        ("output_shapes", "; ".join(_dims(t) for t in layer.outputs)),
        ("input_formats", "; ".join(t.format or "?" for t in layer.inputs)),
        ("output_formats", "; ".join(t.format or "?" for t in layer.outputs)),
        ("average_ms", None if avg_ms is None else f"{avg_ms:.6g}")]
    pairs += sorted(layer.params.items())
    return [_kv(k, v) for k, v in pairs if v not in (None, "")]


def label(layer: LayerRecord) -> str:
    """What the node box shows: the layer kind (Convolution, Reformat, ...), else its runner, else its name (cut
    to MAX_LABEL_CHARS: the box is as wide as its label; the side panel has the whole name)."""
    return layer.parameter_type or layer.layer_type or truncate(layer.name, MAX_LABEL_CHARS)


def _io_tensors(engine: EngineInfo) -> tuple[list[str], list[str]]:
    """(graph inputs, graph outputs): tensors read but produced by no layer (bindings first); the bindings some
    layer produces, or without bindings the tensors produced and never read."""
    produced = {t.name for layer in engine.layers for t in layer.outputs}
    read = [t.name for layer in engine.layers for t in layer.inputs]
    inputs = [b for b in engine.bindings if b in read and b not in produced]
    inputs += [t for t in dict.fromkeys(read) if t not in produced and t not in inputs]
    outputs = [b for b in engine.bindings if b in produced] if engine.bindings else \
        [t for t in dict.fromkeys(t.name for layer in engine.layers for t in layer.outputs) if t not in set(read)]
    return inputs, outputs


def _edges(engine: EngineInfo, ids: list[str], inputs: list[str]) -> list[list[dict[str, str]]]:
    """Each layer's incoming edges: from the layer producing each input tensor, or from GraphInputs."""
    producer = {t.name: (ids[i], str(k)) for i, layer in enumerate(engine.layers) for k, t in enumerate(layer.outputs)}
    producer.update({t: (INPUTS_NODE, str(k)) for k, t in enumerate(inputs)})
    if not has_tensors(engine):        # names only: the layers in engine order
        return [[] if i == 0 else [_edge(ids[i - 1], "0", "0")] for i in range(len(ids))]
    return [[_edge(*producer[t.name], str(k)) for k, t in enumerate(layer.inputs) if t.name in producer]
            for layer in engine.layers]


def _edge(source: str, output: str, target_input: str) -> dict[str, str]:
    return {"sourceNodeId": source, "sourceNodeOutputId": output, "targetNodeInputId": target_input}


def graph_collection(engine: EngineInfo, graph_id: str, collection_label: str,
                     profile: Profile | None = None) -> dict[str, Any]:
    """The GraphCollection JSON (`{"label", "graphs": [Graph]}`) Model Explorer's JSON adapter reads."""
    ids, times = node_ids(engine), average_ms(profile or engine.profile)
    spaces, groups = namespaces(engine)
    inputs, outputs = _io_tensors(engine) if has_tensors(engine) else ([], [])
    edges = _edges(engine, ids, inputs)
    nodes = []
    if inputs:
        nodes.append({"id": INPUTS_NODE, "label": INPUTS_NODE, "namespace": INPUTS_NODE, "attrs": [],
                      "incomingEdges": [], "outputsMetadata": [{"id": str(k), "attrs": [_kv(TENSOR_TAG, t)]}
                                                               for k, t in enumerate(inputs)]})
    for i, layer in enumerate(engine.layers):
        nodes.append({"id": ids[i], "label": label(layer), "namespace": spaces[i],
                      "attrs": layer_attrs(layer, times.get(layer.name)), "incomingEdges": edges[i],
                      "inputsMetadata": _tensor_metadata(layer.inputs),
                      "outputsMetadata": _tensor_metadata(layer.outputs)})
    if outputs:
        producer = {t.name: (ids[i], str(k)) for i, l in enumerate(engine.layers) for k, t in enumerate(l.outputs)}
        nodes.append({"id": OUTPUTS_NODE, "label": OUTPUTS_NODE, "namespace": OUTPUTS_NODE, "attrs": [],
                      "incomingEdges": [_edge(*producer[t], str(k)) for k, t in enumerate(outputs)],
                      "inputsMetadata": [{"id": str(k), "attrs": [_kv(TENSOR_TAG, t)]} for k, t in enumerate(outputs)]})
    groups[""] = graph_attributes(engine, times)
    return {"label": collection_label, "graphs": [{"id": graph_id, "nodes": nodes, "groupNodeAttributes": groups}]}


def graph_attributes(engine: EngineInfo, times: dict[str, float]) -> dict[str, str]:
    """What the side panel shows with nothing selected."""
    attrs = {"source": engine.source, "verbosity": engine.verbosity, "layers": str(len(engine.layers)),
             "precisions": ", ".join(f"{p} {n}" for p, n in sorted(engine.precisions.items())),
             "bindings": ", ".join(engine.bindings)}
    if not has_tensors(engine):
        attrs["edges"] = "no tensor information (layer names only): layers chained in engine order"
    if times:
        attrs["total_average_ms"] = f"{sum(times.get(l.name, 0.0) for l in engine.layers):.6g}"
    if engine.notes:
        attrs["notes"] = "\n".join(engine.notes)
    return {k: v for k, v in attrs.items() if v}


# ---- node data ---------------------------------------------------------------------------------------------------

def average_ms(profile: Profile | None) -> dict[str, float]:
    return {r.name: r.average_ms for r in profile.records} if profile else {}


def _overlay(graph_id: str, name: str, results: dict[str, dict[str, Any]], **options: Any) -> dict[str, Any]:
    """A node-data file keyed by graph id (`ModelNodeData.graphsData` as Model Explorer writes it)."""
    return {graph_id: {"name": name, "results": results, **options}}


def precision_overlay(engine: EngineInfo, graph_id: str) -> dict[str, Any] | None:
    """Each layer's precision as a label, coloured as `kiln draw` colours it; None when no layer shows one."""
    results = {node_id: {"value": layer.precision, "bgColor": PRECISION_COLOURS.get(
                             UNSIGNED_AS.get(layer.precision, layer.precision), PRECISION_COLOURS["unknown"])}
               for node_id, layer in zip(node_ids(engine), engine.layers) if layer.precision}
    return _overlay(graph_id, "precision", results, showExpandedSummaryOnGroupNode=True,
                    showLabelCountColumnsInChildrenStatsTable=True) if results else None


def kernel_family(layer: LayerRecord) -> str | None:
    """What the tactic overlay colours by: kiln's tactic source ("onednn" of "onednn.conv2d_nhwc_prepacked"), a
    TensorRT kernel name's first three fields ("sm80_xmma_fprop"), else the runner (LayerType)."""
    name = layer.tactic_name or ""
    if "." in name:
        return name.split(".")[0]
    if name.count("_") >= 2:
        return "_".join(name.split("_")[:3])
    return layer.layer_type


def tactic_overlay(engine: EngineInfo, graph_id: str) -> dict[str, Any] | None:
    """Each layer's tactic (its name, else its value) as a label, coloured by its kernel family."""
    families = list(dict.fromkeys(kernel_family(layer) for layer in engine.layers))
    colour = {f: FAMILY_PALETTE[i % len(FAMILY_PALETTE)] for i, f in enumerate(f for f in families if f)}
    results = {}
    for node_id, layer in zip(node_ids(engine), engine.layers):
        tactic, family = layer.tactic_name or layer.tactic_value, kernel_family(layer)
        if tactic:
            results[node_id] = {"value": tactic, **({"bgColor": colour[family]} if family else {})}
    return _overlay(graph_id, "tactic", results, showLabelCountColumnsInChildrenStatsTable=True) if results else None


def latency_overlay(engine: EngineInfo, graph_id: str, profile: Profile, where: str) -> dict[str, Any]:
    """Each timed layer's average time (ms) on a white-to-red gradient. An Error naming `where` when the profile
    times none of the engine's layers (a profile of another engine)."""
    times = average_ms(profile)
    results = {node_id: {"value": round(times[layer.name], 6)}
               for node_id, layer in zip(node_ids(engine), engine.layers) if layer.name in times}
    if not results:
        raise Error(f"{where}: the profile times none of this engine's {len(engine.layers)} layers (its names are "
                    "another engine's); hint: pass the --exportProfile of the same engine")
    return _overlay(graph_id, "latency (average ms)", results, gradient=[dict(g) for g in LATENCY_GRADIENT])


# ---- files -------------------------------------------------------------------------------------------------------

def write_model_explorer(engine: EngineInfo, out_dir: str | os.PathLike, name: str, profile: Profile | None = None,
                         profile_path: str = "<profile>") -> ExplorerFiles:
    """Write graph.json and the overlays into out_dir (created if needed), each atomically. `name` is the graph
    id and the collection label. A latency.json left by an earlier export with a profile is removed when this
    one has none, so the folder never pairs a graph with another engine's times."""
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise Error(f"{folder}: exists and is not a folder; hint: -o names the folder the files go into")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Error(f"{folder}: cannot create the folder ({exc.strerror or exc})") from None
    overlays = {PRECISION_FILE: precision_overlay(engine, name), TACTIC_FILE: tactic_overlay(engine, name),
                LATENCY_FILE: latency_overlay(engine, name, profile, profile_path) if profile else None}
    written, removed = [], []
    for file_name, doc in overlays.items():
        path = folder / file_name
        if doc is not None:
            atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
            written.append(path)
        elif path.exists():
            path.unlink()
            removed.append(path)
    graph = folder / GRAPH_FILE
    atomic_write_text(graph, json.dumps(graph_collection(engine, name, name, profile), indent=1) + "\n")
    return ExplorerFiles(graph, tuple(written), tuple(removed))
