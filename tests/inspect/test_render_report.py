"""kiln.inspect.render (DOT/SVG) and kiln.inspect.report (self-contained HTML) on the real TensorRT fixtures and
on a kiln engine with a region; the `kiln draw` and `kiln report` commands as a user runs them."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import Error
from kiln.inspect.lint import lint
from kiln.trt.records import EngineInfo, LayerRecord, Profile, ProfileRecord, TensorInfo
from kiln.trt.artifacts import read_artifact
from kiln.inspect.render import PRECISION_COLOURS, QDQ_COLOUR, render_svg, to_dot
from kiln.inspect.report import html_report
from tests.conftest import force_plan, make_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DETAILED = FIXTURES / "resnet18_trt10_detailed.layers.json"
NAMES_ONLY = FIXTURES / "resnet18_trt10_names_only.layers.json"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
LAYER_NODE = re.compile(r"^\s*L\d+ \[", re.MULTILINE)


def profile_for(engine: EngineInfo, ms: float = 0.1) -> Profile:
    n = len(engine.layers)
    return Profile(10, tuple(ProfileRecord(l.name, ms * 10, ms, ms, 100.0 / n) for l in engine.layers))


def profile_json(engine: EngineInfo) -> str:
    return json.dumps([{"count": 10}] + [{"name": l.name, "timeMs": 1.0, "averageMs": 0.1, "medianMs": 0.1,
                                          "percentage": 4.0} for l in engine.layers])


@pytest.fixture(scope="module")
def region_engine(tmp_path_factory):
    """A kiln engine whose whole graph is one onnxruntime region (that plan forced to win), saved and read back."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="mul"),
             helper.make_node("MaxPool", ["m"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "p"], ["y"], name="add")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], inits)
    with pytest.MonkeyPatch.context() as mp:
        force_plan(mp, "onnxruntime")
        engine = kiln.build(model, avg_timing=1, min_timing=1)
    path = tmp_path_factory.mktemp("render") / "region.kiln"
    engine.save(path)
    return path


# ---- DOT ---------------------------------------------------------------------------------------------------------

def test_dot_of_resnet18_detailed():
    engine = read_artifact(DETAILED)
    dot = to_dot(engine)
    assert dot.startswith("digraph engine {") and dot.rstrip().endswith("}")
    assert len(LAYER_NODE.findall(dot)) == 25
    assert f'fillcolor="{PRECISION_COLOURS["INT8"]}"' in dot and "legend [" in dot
    assert "resnetv15_conv0_fwd\\nresnetv15_batchnorm0_fwd\\nresnetv15_relu0_fwd" in dot   # stacked fused names
    assert "CaskConvActPool" in dot
    assert re.search(r'T\d+ \[label="resnetv15_dense0_fwd", shape=ellipse', dot)        # the output binding
    assert re.search(r'T\d+ \[label="data", shape=ellipse', dot)
    assert "shape=cds" in dot                                                             # the Reformat / NoOps
    assert len(re.findall(r"^\s*L\d+ -> L\d+;", dot, re.MULTILINE)) >= 24
    assert "chain" not in dot


def test_dot_of_names_only_is_a_chain():
    engine = read_artifact(NAMES_ONLY)
    dot = to_dot(engine)
    assert len(LAYER_NODE.findall(dot)) == 25
    edges = re.findall(r"^\s*L(\d+) -> L(\d+);", dot, re.MULTILINE)
    assert [(int(a), int(b)) for a, b in edges] == [(i, i + 1) for i in range(24)]
    assert "layer names only" in dot and "chain" in dot
    assert "T0" not in dot


def test_dot_with_profile_shows_average_ms():
    engine = read_artifact(DETAILED)
    dot = to_dot(engine, profile_for(engine, 0.125))
    assert dot.count("0.125 ms") == 25


def test_dot_escapes_truncates_and_colours_special_layers():
    weird = 'a"b\\c{d}<e>|f + ' + "x" * 100 + " || g"
    fp16 = "Row major linear FP16 format"
    layers = (LayerRecord(weird, "CaskConvolution", "Convolution", (TensorInfo("in", (1, 8), fp16),),
                          (TensorInfo("mid", (1, 8), fp16),)),
              LayerRecord("QuantizeLinear_3", "Reformat", "Reformat", (TensorInfo("mid", (1, 8), "Half"),),
                          (TensorInfo("q", (1, 8), "Int8"),), {"Origin": "QDQ"}),
              LayerRecord("DequantizeLinear_7 + QuantizeLinear_9 + conv_1", "CaskConvolution", "Convolution",
                          (TensorInfo("q", (1, 8), "Int8"),), (TensorInfo("out", (1, 8), "Int8"),)))
    dot = to_dot(EngineInfo("test", "detailed", layers, ("in", "out")))
    label = re.search(r'L0 \[label="(.*?)", shape', dot).group(1)
    assert label.startswith('a\\"b\\\\c\\{d\\}\\<e\\>\\|f\\n') and "…" in label and label.count("\\n") == 3
    assert f'L1 [label="QuantizeLinear_3\\nReformat · INT8", shape=cds, style="filled,dashed", ' \
           f'fillcolor="{QDQ_COLOUR}"' in dot
    assert f'fillcolor="{PRECISION_COLOURS["INT8"]}"' in re.search(r"L2 \[.*", dot).group(0)   # a conv, not Q/DQ
    assert PRECISION_COLOURS["FP16"] in dot
    if shutil.which("dot"):
        svg = render_svg(dot)
        assert "a&quot;b\\c{d}&lt;e&gt;|f" in svg


def test_dot_clusters_a_kiln_region(region_engine):
    engine = read_artifact(region_engine)
    regions = {l.region for l in engine.layers}
    assert len(regions) == 1 and next(iter(regions)).startswith("{ForeignNode[")
    dot = to_dot(engine)
    assert "subgraph cluster_0 {" in dot and 'label="\\{ForeignNode[' in dot
    cluster = dot.split("subgraph cluster_0 {")[1].split("\n  }\n")[0]
    assert len(LAYER_NODE.findall(dot)) == len(engine.layers) == len(LAYER_NODE.findall(cluster)) >= 3
    assert len(re.findall(r"^\s*L\d+ -> L\d+;", dot, re.MULTILINE)) >= len(engine.layers) - 1
    if shutil.which("dot"):
        assert '<g id="clust1" class="cluster">' in render_svg(dot)


@needs_dot
def test_render_svg_of_resnet18():
    svg = render_svg(to_dot(read_artifact(DETAILED)))
    assert "<svg" in svg and svg.rstrip().endswith("</svg>") and svg.count('class="node"') == 25 + 2 + 1


def test_render_svg_without_dot_says_how_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(Error, match=r"Graphviz 'dot' not found; install graphviz \(make does: apt-get install"):
        render_svg("digraph { a }")


@needs_dot
def test_render_svg_reports_dot_errors():
    with pytest.raises(Error, match="Graphviz 'dot' failed"):
        render_svg("digraph { this is not dot")


# ---- HTML --------------------------------------------------------------------------------------------------------

class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: dict[str, int] = {}

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1


def assert_self_contained(page: str) -> None:
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    assert not re.search(r"<(script|link|img)[^>]*\b(src|href)=", page)


@needs_dot
def test_html_report_with_profile_findings_and_graph():
    engine = read_artifact(DETAILED)
    profile = profile_for(engine)
    findings = lint(engine, profile)
    page = html_report(engine, profile, findings, svg=render_svg(to_dot(engine, profile)), title="resnet18 <int8>")
    assert_self_contained(page)
    assert page.startswith("<!DOCTYPE html>") and "<title>resnet18 &lt;int8&gt;</title>" in page
    assert '<table class="sortable" id="layers">' in page and page.count("<tr>") >= 25
    assert "Time by layer type (average ms)" in page and "Time by precision (average ms)" in page
    assert "2.5000 ms" in page                                   # total average time in the summary
    assert "Lint findings" in page and all(f.rule_id in page for f in findings)
    assert '<div class=graph><svg' in page and "<script>" in page and "addEventListener" in page
    parser = _Tags()
    parser.feed(page)
    assert parser.tags["svg"] == 3 and parser.tags["table"] >= 3 and parser.tags["script"] == 1


def test_html_report_without_profile_counts_layers_and_escapes_names():
    engine = read_artifact(DETAILED)
    evil = LayerRecord("<script>alert(1)</script> + x", "Reformat", outputs=(TensorInfo("o", (1,), "FP32"),))
    engine = EngineInfo(engine.source, engine.verbosity, engine.layers + (evil,), engine.bindings)
    page = html_report(engine, findings=[], graph_note="Graph not included: Graphviz 'dot' not found")
    assert_self_contained(page)
    assert "Layer count by type (no profile)" in page and "Layer count by precision (no profile)" in page
    assert "No findings." in page and "Graph not included" in page
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


# ---- CLI ---------------------------------------------------------------------------------------------------------

def kiln_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=120)


@needs_dot
def test_cli_draw_svg_and_dot(tmp_path):
    engine = read_artifact(DETAILED)
    (tmp_path / "p.json").write_text(profile_json(engine))
    r = kiln_cli("draw", str(DETAILED), "--profile", str(tmp_path / "p.json"), "-o", str(tmp_path / "g.svg"))
    assert r.returncode == 0, r.stderr
    assert "<svg" in (tmp_path / "g.svg").read_text() and "0.100 ms" in (tmp_path / "g.svg").read_text()
    r = kiln_cli("draw", str(NAMES_ONLY), "-o", str(tmp_path / "g.dot"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.dot").read_text().startswith("digraph engine {")


@needs_dot
def test_cli_report(tmp_path, region_engine):
    out = tmp_path / "r.html"
    r = kiln_cli("report", str(region_engine), "-o", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert_self_contained(page)
    assert "<div class=graph><svg" in page and "ForeignNode" in page and "kiln report: region.kiln" in page


def test_cli_report_without_dot_notes_it(tmp_path, monkeypatch):
    from kiln.cli.main import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["report", str(DETAILED), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "Graph not included: Graphviz &#x27;dot&#x27; not found; install graphviz" in page
    assert "<div class=graph>" not in page


def test_cli_bad_inputs_exit_2_with_a_hint(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"Layers": [')
    r = kiln_cli("draw", str(bad), "-o", str(tmp_path / "x.svg"))
    assert r.returncode == 2 and "hint:" in r.stderr and not (tmp_path / "x.svg").exists()
    r = kiln_cli("report", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "hint: check the path" in r.stderr and not (tmp_path / "x.html").exists()
    r = kiln_cli("draw", str(DETAILED), "-o", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "hint: name it .svg" in r.stderr


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="no /usr/bin/chromium for a headless render")
def test_report_renders_headless(tmp_path):
    page = tmp_path / "r.html"
    page.write_text(html_report(read_artifact(DETAILED), findings=[]))
    flags = ["/usr/bin/chromium", "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    r = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'id="layers"' in r.stdout
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "Error" in line], console
    shot = tmp_path / "report.png"
    r = subprocess.run(flags + ["--window-size=1280,1600", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.is_file() and shot.stat().st_size > 10_000
