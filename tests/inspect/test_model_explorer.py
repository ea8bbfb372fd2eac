"""`kiln export model-explorer` on real files (TensorRT 10 layer info and one-line dumps, the demo kiln engine and a
Q/DQ kiln engine): the JSON parses into Model Explorer's own data classes (`dacite.from_dict`, as the package
reads graphs) and matches the layers, edges, precisions, tactics and times read straight from the source files;
then Model Explorer's server shows it in headless Chromium."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.cli.main import main as kiln_main
from kiln.inspect.render import PRECISION_COLOURS
from kiln.trt.artifacts import read_artifact
from kiln.tools.model_explorer import module_path, onnx_nodes, write_model_explorer
from kiln.trt.layer_info import dumps
from kiln.trt.records import LayerRecord

dacite = pytest.importorskip("dacite")
graph_builder = pytest.importorskip("model_explorer.graph_builder")
node_data_builder = pytest.importorskip("model_explorer.node_data_builder")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESNET18 = FIXTURES / "resnet18_trt10_detailed.layers.json"
RESNET18_NAMES = FIXTURES / "resnet18_trt10_names_only.layers.json"
BERT_ONELINE = FIXTURES / "bert_fp16_trt10.10_detailed.oneline.log"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def load_graph(path: Path):
    """graph.json as Model Explorer's GraphCollection (strict: an unknown key fails), and its one Graph."""
    collection = dacite.from_dict(graph_builder.GraphCollection, json.loads(path.read_text()),
                                  dacite.Config(strict=True))
    assert len(collection.graphs) == 1
    return collection, collection.graphs[0]


def load_overlay(path: Path, graph_id: str, labels: bool):
    """A node-data file keyed by graph id, as GraphNodeData. The package types `value` as a number while its web
    app shows strings as labels (the browser test checks that), so label overlays skip only the type check."""
    doc = json.loads(path.read_text())
    assert list(doc) == [graph_id]
    data = dacite.from_dict(node_data_builder.GraphNodeData, doc[graph_id],
                            dacite.Config(strict=True, check_types=not labels))
    if labels:
        assert all(isinstance(r.value, str) for r in data.results.values())
    return data


def by_id(graph):
    return {n.id: n for n in graph.nodes}


def attr(node, key: str) -> str | None:
    return next((kv.value for kv in node.attrs if kv.key == key), None)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The demo CNN as a kiln engine with a profile, and the same model quantized (Q/DQ, INT8) as a kiln engine."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from kiln.cli.run import profile
    from kiln.demo import demo_model
    from kiln.trt.profile import profile_json

    folder = tmp_path_factory.mktemp("explorer")
    demo_model(folder / "demo.onnx")
    engine = kiln.build(str(folder / "demo.onnx"), autotune=False)
    engine.save(folder / "demo.kiln")
    (folder / "demo.profile.json").write_text(profile_json(profile(engine, engine.random_inputs(), 3)))

    class Calibration(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter([{"image": rng.standard_normal((1, 3, 64, 64)).astype(np.float32)} for _ in range(2)])

        def get_next(self):
            return next(self.batches, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant_pre_process(str(folder / "demo.onnx"), str(folder / "pre.onnx"))
        quantize_static(str(folder / "pre.onnx"), str(folder / "qdq.onnx"), Calibration(),
                        quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    kiln.build(str(folder / "qdq.onnx"), autotune=False).save(folder / "qdq.kiln")
    return folder


# ---- ONNX node names ---------------------------------------------------------------------------------------------

def test_onnx_nodes_and_their_module_path():
    assert onnx_nodes(LayerRecord("/block/c2/Conv + /block/b2/BatchNormalization + /block/Add")) == \
        ("/block/c2/Conv", "/block/b2/BatchNormalization", "/block/Add")
    assert onnx_nodes(LayerRecord("PWN(PWN(/act/Sigmoid), /act/Mul)")) == ("/act/Sigmoid", "/act/Mul")
    assert onnx_nodes(LayerRecord("{ForeignNode[/enc/l.0/MatMul.../enc/l.1/Add]}")) == ("/enc/l.0/MatMul",
                                                                                        "/enc/l.1/Add")
    assert onnx_nodes(LayerRecord("q || k", origin=("/a/q", "/a/k"))) == ("/a/q", "/a/k")
    assert onnx_nodes(LayerRecord("Reformatting CopyNode for Input Tensor 0 to conv", layer_type="Reformat")) == ()
    assert module_path(("/block/c1/Conv", "/block/b1/BatchNormalization", "/block/Relu")) == ("block",)
    assert module_path(("/dw/dw.2/Conv",)) == ("dw", "dw.2")
    assert module_path(("/stem/stem.2/Relu_output_0_DequantizeLinear", "/dw/dw.0/Conv",
                        "/dw/dw.0/Conv_output_0_QuantizeLinear")) == ("dw", "dw.0")
    assert module_path(("/dw/dw.0/Conv_output_0_DequantizeLinear",)) == ("dw", "dw.0")
    assert module_path(("resnetv15_conv0_fwd",)) == ()


# ---- TensorRT files ----------------------------------------------------------------------------------------------

def test_trt10_resnet18_layers_edges_precisions_and_tactics(tmp_path):
    raw = json.loads(RESNET18.read_text())["Layers"]
    files = write_model_explorer(read_artifact(RESNET18), tmp_path, "r18")
    assert [p.name for p in files.overlays] == ["precision.json", "tactic.json"]
    collection, graph = load_graph(tmp_path / "graph.json")
    assert collection.label == graph.id == "r18"
    nodes = by_id(graph)
    assert [n.id for n in graph.nodes] == ["GraphInputs"] + [l["Name"] for l in raw] + ["GraphOutputs"]
    assert nodes["GraphInputs"].label == nodes["GraphInputs"].namespace == "GraphInputs"
    assert [kv.value for m in nodes["GraphInputs"].outputsMetadata for kv in m.attrs] == ["data"]

    producer = {t["Name"]: (l["Name"], str(k)) for l in raw for k, t in enumerate(l["Outputs"])}
    producer["data"] = ("GraphInputs", "0")
    for layer in raw:                                     # every input tensor is one edge from its producer
        node = nodes[layer["Name"]]
        edges = [(e.sourceNodeId, e.sourceNodeOutputId, e.targetNodeInputId) for e in node.incomingEdges]
        assert edges == [(*producer[t["Name"]], str(k)) for k, t in enumerate(layer["Inputs"])]
        assert nodes[layer["Name"]].namespace == ""       # TensorRT's ONNX names here carry no module path
    residual = nodes[raw[3]["Name"]]
    assert [e.sourceNodeId for e in residual.incomingEdges] == [raw[2]["Name"], raw[1]["Name"]]
    assert [(e.sourceNodeId, e.sourceNodeOutputId, e.targetNodeInputId) for e in nodes["GraphOutputs"].incomingEdges] \
        == [(*producer["resnetv15_dense0_fwd"], "0")]

    conv0 = nodes[raw[1]["Name"]]
    assert conv0.label == "ConvActPool" and attr(conv0, "layer_type") == "CaskConvActPool"
    assert attr(conv0, "onnx_nodes").split("\n") == re.findall(r"\[ONNX Layer: (.*?)\]", raw[1]["Metadata"])
    assert attr(conv0, "output_shapes") == "1x64x56x56" and attr(conv0, "ConvKernel") == "[7, 7]"
    assert attr(conv0, "output_formats") == "Thirty-two wide channel vectorized row major Int8 format"
    assert [kv.value for kv in conv0.outputsMetadata[0].attrs][:2] == ["resnetv15_pool0_fwd", "1x64x56x56"]

    precision = load_overlay(tmp_path / "precision.json", "r18", labels=True)
    assert Counter(r.value for r in precision.results.values()) == {"INT8": 23, "FP32": 2}
    for layer in raw:                                      # the output's Format/Datatype names the precision
        fmt = layer["Outputs"][0]["Format/Datatype"]
        want = "INT8" if "Int8" in fmt else "FP32" if "FP32" in fmt else None
        assert precision.results[layer["Name"]].value == want
        assert precision.results[layer["Name"]].bgColor == PRECISION_COLOURS[want]
    tactic = load_overlay(tmp_path / "tactic.json", "r18", labels=True)
    assert {k: r.value for k, r in tactic.results.items()} == \
        {l["Name"]: l.get("TacticName") or l["TacticValue"] for l in raw}
    colour = {l["Name"]: tactic.results[l["Name"]].bgColor for l in raw}     # one colour per kernel family
    fprop = {colour[l["Name"]] for l in raw if l.get("TacticName", "").startswith("sm80_xmma_fprop")}
    assert len(fprop) == 1 and colour[raw[0]["Name"]] not in fprop          # the Reformat: no kernel name
    assert colour[raw[-4]["Name"]] not in fprop                             # sm72_xmma_pooling


def test_trt_oneline_dump_groups_layers_by_their_onnx_module(tmp_path):
    write_model_explorer(read_artifact(BERT_ONELINE), tmp_path, "bert")
    _, graph = load_graph(tmp_path / "graph.json")
    nodes = by_id(graph)
    assert len(nodes) == 89 + 2
    dense = nodes["/encoder/layers_0/mha/output/dense/MatMul_myl0_4"]
    assert dense.namespace == "encoder/layers.0/mha/output/dense" and dense.label == "gemm"
    assert attr(dense, "onnx_nodes") == "/encoder/layers.0/mha/output/dense/MatMul\n" \
                                        "/encoder/layers.0/mha/output/dense/Add"
    assert [e.sourceNodeId for e in dense.incomingEdges] == ["_gemm_mha_v2_myl0_3"]
    precision = load_overlay(tmp_path / "precision.json", "bert", labels=True)
    assert precision.results[dense.id].value == "FP16"


def test_names_only_layer_info_is_a_chain_without_overlays(tmp_path):
    raw = json.loads(RESNET18_NAMES.read_text())["Layers"]
    (tmp_path / "latency.json").write_text("{}")           # an earlier export's: no longer true
    files = write_model_explorer(read_artifact(RESNET18_NAMES), tmp_path, "names")
    assert files.overlays == () and [p.name for p in files.removed] == ["latency.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.json"]
    _, graph = load_graph(tmp_path / "graph.json")
    assert [n.id for n in graph.nodes] == raw
    long = next(n for n in graph.nodes if len(n.id) > 48)
    assert long.label == long.id[:47] + "…" and attr(long, "name") == long.id   # the box stays small
    assert [[e.sourceNodeId for e in n.incomingEdges] for n in graph.nodes] == [[]] + [[x] for x in raw[:-1]]
    assert "engine order" in graph.groupNodeAttributes[""]["edges"]


# ---- kiln engines ------------------------------------------------------------------------------------------------

def test_demo_engine_with_profile(engines, tmp_path):
    engine = kiln.load(engines / "demo.kiln")
    plan = engine.plan
    inner = [l for outer in plan.layers for l in (outer.inner or (outer,))]
    profile = {r["name"]: r["averageMs"] for r in json.loads((engines / "demo.profile.json").read_text())[1:]}
    assert kiln_main(["export", "model-explorer", str(engines / "demo.kiln"), "-o", str(tmp_path),
                      "--profile", str(engines / "demo.profile.json")]) == 0
    _, graph = load_graph(tmp_path / "graph.json")
    assert graph.id == "demo"
    nodes = by_id(graph)
    assert [n.id for n in graph.nodes[1:-1]] == [l.name for l in inner]
    assert nodes["/dw/dw.2/Conv"].namespace == "dw/dw.2"
    residual = next(l for l in inner if "/block/Add" in l.origin)
    assert nodes[residual.name].namespace == "block"
    assert attr(nodes[residual.name], "onnx_nodes").split("\n") == list(residual.origin)
    produced_by = {t.name: l.name for l in inner for t in l.outputs}
    assert [e.sourceNodeId for e in nodes[residual.name].incomingEdges] == \
        [produced_by.get(t.name, "GraphInputs") for t in residual.inputs]
    assert [kv.value for kv in nodes["GraphInputs"].outputsMetadata[0].attrs] == ["image"]
    assert nodes["GraphOutputs"].incomingEdges[0].sourceNodeId == produced_by["probs"]

    tactic = load_overlay(tmp_path / "tactic.json", "demo", labels=True)   # as the layer info names them
    layer_info = json.loads(dumps(engine.layer_info("detailed")))["Layers"]
    assert {k: r.value for k, r in tactic.results.items()} == \
        {l["Name"]: l.get("TacticName") or l["TacticValue"] for l in layer_info}
    assert tactic.results["/pool/MaxPool"].value == next(l.tactic_name for l in inner if l.name == "/pool/MaxPool")
    by_source: dict[str, set[str]] = {}                                  # coloured by tactic source
    for l in layer_info:
        if l.get("TacticName"):
            by_source.setdefault(l["TacticName"].split(".")[0], set()).add(tactic.results[l["Name"]].bgColor)
    assert all(len(c) == 1 for c in by_source.values()) and len(set.union(*by_source.values())) == len(by_source)
    precision = load_overlay(tmp_path / "precision.json", "demo", labels=True)
    assert set(r.value for r in precision.results.values()) == {"FP32"}
    latency = load_overlay(tmp_path / "latency.json", "demo", labels=False)
    assert latency.results and {k: r.value for k, r in latency.results.items()} == \
        {k: pytest.approx(v, abs=1e-6) for k, v in profile.items() if k in nodes}
    assert [g.stop for g in latency.gradient][::2] == [0, 1]
    assert attr(nodes[inner[1].name], "average_ms") == f"{profile[inner[1].name]:.6g}"


def test_qdq_engine_shows_int8_layers_in_their_modules(engines, tmp_path):
    info = read_artifact(engines / "qdq.kiln")
    write_model_explorer(info, tmp_path, "qdq")
    _, graph = load_graph(tmp_path / "graph.json")
    nodes = by_id(graph)
    precision = load_overlay(tmp_path / "precision.json", "qdq", labels=True)
    stem = next(l for l in info.layers if "/stem/stem.0/Conv" in l.origin)
    assert any(o.endswith("QuantizeLinear") for o in stem.origin)      # the conv absorbed its Q/DQ nodes
    assert nodes[stem.name].namespace == "stem/stem.0"
    dw0 = next(l for l in info.layers if "/dw/dw.0/Conv" in l.origin)
    assert "/stem/stem.2/Relu_output_0_DequantizeLinear" in dw0.origin and nodes[dw0.name].namespace == "dw/dw.0"
    assert precision.results[stem.name].value == "INT8"
    assert precision.results[stem.name].bgColor == PRECISION_COLOURS["INT8"]
    softmax = next(l for l in info.layers if "/Softmax" in l.origin)   # DQ -> Softmax -> Q: one INT8 layer
    assert precision.results[softmax.name].value == "INT8"
    mean = next(l for l in info.layers if l.origin == ("/ReduceMean",))
    assert precision.results[mean.name].value == "FP32"
    assert Counter(r.value for r in precision.results.values())["INT8"] >= 5


def test_a_region_of_a_kiln_engine_is_one_group(tmp_path):
    """A plan forced onto one onnxruntime region: its layers sit in ForeignNode_0, then in their modules."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.conftest import force_plan, make_model

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="/enc/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="/enc/act/Sigmoid"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="/enc/act/Mul"),
             helper.make_node("MaxPool", ["m"], ["y"], name="/head/MaxPool", kernel_shape=[2, 2], strides=[2, 2])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w])
    with pytest.MonkeyPatch.context() as mp:
        force_plan(mp, "onnxruntime")
        kiln.build(model, avg_timing=1, min_timing=1).save(tmp_path / "region.kiln")
    plan = kiln.load(tmp_path / "region.kiln").plan
    (region,) = [l for l in plan.layers if l.inner]
    write_model_explorer(read_artifact(tmp_path / "region.kiln"), tmp_path / "me", "region")
    _, graph = load_graph(tmp_path / "me" / "graph.json")
    nodes = by_id(graph)
    assert graph.groupNodeAttributes["ForeignNode_0"] == {"region": region.name, "layers": str(len(region.inner))}
    for layer in region.inner:
        assert nodes[layer.name].namespace.split("/")[0] == "ForeignNode_0"
        assert attr(nodes[layer.name], "region") == region.name
    pool = next(l for l in region.inner if "/head/MaxPool" in l.origin)
    assert nodes[pool.name].namespace == "ForeignNode_0/head"


# ---- the command ---------------------------------------------------------------------------------------------------

def test_cli_prints_the_command_and_exits_2_naming_bad_input(tmp_path, capfd):
    out = tmp_path / "me"
    assert kiln_main(["export", "model-explorer", str(RESNET18), "-o", str(out)]) == 0
    printed = capfd.readouterr().out
    assert f"model-explorer {out / 'graph.json'} --node_data_paths={out / 'precision.json'},{out / 'tactic.json'}" \
        in printed
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    other_profile = tmp_path / "other.json"
    other_profile.write_text(json.dumps([{"count": 1}, {"name": "not_a_layer", "timeMs": 1, "averageMs": 1,
                                                        "medianMs": 1, "percentage": 100}]))
    assert kiln_main(["export", "model-explorer", str(RESNET18), "-o", str(out), "--profile", str(other_profile)]) == 2
    assert f"{other_profile}: the profile times none of this engine's 25 layers" in capfd.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before     # nothing written, nothing half-written

    broken = tmp_path / "broken.json"
    broken.write_text('{"Layers": [')
    assert kiln_main(["export", "model-explorer", str(broken), "-o", str(tmp_path / "x")]) == 2
    assert f"{broken}: not valid JSON" in capfd.readouterr().err
    assert kiln_main(["export", "model-explorer", str(tmp_path / "missing.kiln"), "-o", str(tmp_path / "x")]) == 2
    assert "missing.kiln: cannot read file" in capfd.readouterr().err
    assert not (tmp_path / "x").exists()
    assert kiln_main(["export", "model-explorer", str(RESNET18), "-o", str(broken)]) == 2
    assert f"{broken}: exists and is not a folder" in capfd.readouterr().err


# ---- Model Explorer itself ---------------------------------------------------------------------------------------

def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 8080:                    # model-explorer treats 8080 as "pick one for me"
            return port


def _stop(proc: subprocess.Popen) -> None:
    """End a process started in its own session and every process it started (Chromium's renderers): SIGTERM to
    the group, then SIGKILL to whatever of it is left after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            proc.poll()                          # reap the leader, so only live members keep the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            continue
        break
    proc.wait()


def _start_model_explorer(graph: Path, overlays: list[Path]) -> tuple[subprocess.Popen, str | None, list[str]]:
    """model-explorer on a free loopback port; (process, the URL it prints, its output so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "model_explorer", str(graph),
                             f"--node_data_paths={','.join(map(str, overlays))}", "--no_open_in_browser",
                             "--host", "127.0.0.1", "--port", str(_free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        url = next((line.strip() for line in list(lines) if line.startswith("http://127.0.0.1")), None)
        if url:
            return proc, url, lines
        time.sleep(0.1)
    return proc, None, lines


def _page_text(url: str, profile_dir: Path, ready) -> str:
    """Load `url` in headless Chromium and return the page's text once `ready(text)` (or after 30 s)."""
    websocket = pytest.importorskip("websocket")
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
                                "--disable-background-networking", "--no-first-run", f"--user-data-dir={profile_dir}",
                                "--remote-debugging-port=0", "--remote-allow-origins=*", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file, deadline = profile_dir / "DevToolsActivePort", time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and browser.poll() is None, "Chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10))
        ws = websocket.create_connection(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"],
                                         timeout=20)
        calls = iter(range(1, 10_000))

        def call(method: str, **params):
            n = next(calls)
            ws.send(json.dumps({"id": n, "method": method, "params": params}))
            while (reply := json.loads(ws.recv())).get("id") != n:
                pass
            return reply["result"]

        call("Page.navigate", url=url)
        text, deadline = "", time.monotonic() + 30
        while time.monotonic() < deadline and not ready(text):
            time.sleep(0.5)
            text = call("Runtime.evaluate", expression="document.body.innerText", returnByValue=True)["result"] \
                .get("value", "")
        ws.close()
        return text
    finally:
        _stop(browser)


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="headless Chromium is not installed")
def test_model_explorer_shows_the_graph_and_overlays_in_chromium(tmp_path):
    raw = json.loads(RESNET18.read_text())["Layers"]
    files = write_model_explorer(read_artifact(RESNET18), tmp_path / "me", "resnet18")
    server, url, log = _start_model_explorer(files.graph, list(files.overlays))
    try:
        if url is None:
            pytest.skip("model-explorer did not start offline within 60 s: " + " | ".join(log[-5:]))
        with urllib.request.urlopen(url.split("/?")[0] + "/api/v1/read_text_file?path=" + str(files.graph)) as r:
            served = json.loads(json.loads(r.read())["content"])
        assert [n["id"] for n in served["graphs"][0]["nodes"][1:-1]] == [l["Name"] for l in raw]
        text = _page_text(url, tmp_path / "chromium", lambda t: "Node data" in t and "Processing" not in t)
    finally:
        _stop(server)
    flat = re.sub(r"\s+", " ", text)
    assert "resnet18 27 nodes" in flat and "op node count 27" in flat, flat[:500]
    assert "precisions FP32 2, INT8 23" in flat                          # the graph's attributes
    assert re.search(r"NODE DATA PROVIDERS 1 precision .*2 tactic", flat)
    table = flat[flat.rindex("Node data"):]
    for layer in raw:                                      # each row: a node's label, precision and tactic
        fmt = layer["Outputs"][0]["Format/Datatype"]
        row = f" {layer.get('ParameterType') or layer['LayerType']} {'INT8' if 'Int8' in fmt else 'FP32'} " \
              f"{layer.get('TacticName') or layer['TacticValue']} "
        assert row in table, (row, table[:2000])
