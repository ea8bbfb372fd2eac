"""Build progress: the events a build of a small model sends (stages in order, layer counts reaching the total,
the tactics being timed), the rich display those events drive on a (forced) terminal, and no display at all
when kiln build's output goes to pipes or --quiet is given."""
from __future__ import annotations

import io
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.builder.progress import STAGES, BuildProgress
from kiln.cli.progress_display import BuildDisplay, live_build_display, wants_live_display
from tests.conftest import init, make_model, rand


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["s2"], name="sigmoid"),
             helper.make_node("GlobalAveragePool", ["s2"], ["y"], name="pool")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 1, 1])],
                       [init("w1", rand((8, 3, 3, 3))), init("b1", rand((8,), 1)), init("w2", rand((8, 8, 3, 3), 2)),
                        init("b2", rand((8,), 3))])
    path = tmp_path_factory.mktemp("progress") / "small.onnx"
    onnx.save(model, path)
    return path


SOURCES = {"kiln", "torch"}


def test_build_sends_stages_in_order_and_layer_counts_reach_the_total(small_model):
    events: list[BuildProgress] = []
    engine = kiln.build(str(small_model), tactic_sources=SOURCES, avg_timing=1, min_timing=1, progress=events.append)
    assert all(isinstance(e, BuildProgress) for e in events)
    starts = [e.stage for e in events if e.done == 0 and not e.detail]
    assert starts == list(STAGES) and events[-1] == BuildProgress("done", 1, 1, "", events[-1].elapsed_s)
    for stage in STAGES:                              # each stage opens at 0 and closes with done == total
        mine = [e for e in events if e.stage == stage]
        assert mine[0].done == 0 and mine[-1].done == mine[-1].total
    lowering = [e for e in events if e.stage == "lowering"]
    layers = [e for e in lowering if e.detail.startswith("layer '")]
    total = lowering[-1].total
    assert total == len(layers) >= 2 and [e.done for e in layers] == list(range(total))
    assert all(e.total == total for e in layers)
    timed = [e.detail for e in lowering if e.detail.startswith("timing ")]
    assert timed and all(" for layer '" in d for d in timed)
    assert [e.elapsed_s for e in events] == sorted(e.elapsed_s for e in events)
    assert len(engine.plan.layers) >= 1


def test_rich_display_renders_when_forced_onto_a_terminal(small_model):
    from rich.console import Console

    screen = io.StringIO()
    console = Console(force_terminal=True, file=screen, width=160, color_system=None)
    with live_build_display(True, console) as display:
        assert isinstance(display, BuildDisplay)
        kiln.build(str(small_model), tactic_sources=SOURCES, avg_timing=1, min_timing=1, progress=display)
    text = screen.getvalue()
    assert "lowering" in text and "planning" in text and "timing " in text and "for layer '" in text
    done = display.progress.tasks[0]
    assert done.description == "done" and done.completed == done.total
    lowered = [line for line in text.replace("\r", "\n").splitlines() if "lowering" in line and "layers" in line]
    assert lowered and any("0/" in line for line in lowered)


def test_display_wanted_only_on_terminals_without_quiet_or_verbose():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert wants_live_display(False, False, (Tty(), Tty()))
    assert not wants_live_display(False, False, (Tty(), io.StringIO()))
    assert not wants_live_display(True, False, (Tty(), Tty()))
    assert not wants_live_display(False, True, (Tty(), Tty()))
    with live_build_display(False) as display:
        assert display is None


def test_cli_build_with_pipes_shows_no_display_and_quiet_prints_nothing(small_model, tmp_path):
    base = [sys.executable, "-m", "kiln", "build", str(small_model), "--tactic-sources", "kiln,torch",
            "--avg-timing", "1", "--min-timing", "1"]
    r = subprocess.run(base + ["-o", str(tmp_path / "a.kiln")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout + r.stderr and "\r" not in r.stdout and "lowering" not in r.stdout
    assert "Saved engine to" in r.stdout
    r = subprocess.run(base + ["-o", str(tmp_path / "b.kiln"), "--quiet", "--export-layer-info",
                               str(tmp_path / "l.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and (tmp_path / "b.kiln").is_file() and (tmp_path / "l.json").is_file()
