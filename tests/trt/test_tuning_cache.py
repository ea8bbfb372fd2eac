"""TensorRT 11.1's tuning cache (trtexec --tuningCacheFile): the header and iterations read as trtexec writes them,
the best route within the accuracy budget, the time/accuracy trade-off, errors naming file and line, and
`kiln inspect` on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli.main import main
from kiln.errors import ArtifactError
from kiln.trt.artifacts import read_artifact
from kiln.trt.tuning_cache import CRASHED, FAILED, OK, OVER_BUDGET, read_tuning_cache

CACHE = Path(__file__).resolve().parents[1] / "fixtures" / "trt11.1_tuning_cache.jsonl"


def test_reads_header_and_iterations():
    cache = read_artifact(CACHE)
    assert (cache.tuner_version, cache.searching_algorithm, cache.accuracy_algorithm) == ("1.0", "fast", "L1")
    assert (cache.accuracy_threshold, cache.atol, cache.rtol) == (0.01, 1e-05, 0.001)
    assert cache.tuning_expr == "-conv_lowering=[on|off] -kgen:tiling=[0|1|2]" and cache.outputs == ("logits", "boxes")
    assert [it.iteration for it in cache.iterations] == [0, 1, 2, 3, 4, 5]
    assert [cache.status(it) for it in cache.iterations] == [OK, OK, OK, CRASHED, OVER_BUDGET, FAILED]
    crashed = cache.iterations[3]
    assert crashed.accuracy_loss is None and crashed.gpu_time_ms is None and "SIGSEGV" in crashed.error_message
    assert cache.iterations[4].max_accuracy_loss == 0.0214 and cache.iterations[4].line == 6


def test_best_route_is_the_fastest_within_the_accuracy_budget():
    cache = read_artifact(CACHE)
    best = cache.best()   # iteration 4 is faster (1.5018 ms) but its logits loss 0.0214 exceeds epsilon 0.01
    assert (best.iteration, best.build_route, best.gpu_time_ms) == (2, "-kgen:tiling=1", 1.6127)
    assert [it.iteration for it in cache.trade_off()] == [0, 2, 4]


@pytest.mark.parametrize("line,message", [
    ('{"iter":7,"build_route":"-x=1","gpu_time":', "line 4: not valid JSON"),
    ('{"build_route":"-x=1","gpu_time":1.0}', "line 4: no \"iter\""),
    ('{"iter":7,"build_route":"-x=1","gpu_time":"fast"}', "line 4: \"gpu_time\" is 'fast', not a number"),
    ('{"iter":7,"build_route":"-x=1","accuracy_loss":{"logits":"low"}}',
     "line 4: \"accuracy_loss.logits\" is 'low', not a number"),
    ('[1, 2]', "line 4: a JSON list, not an object")])
def test_malformed_lines_name_the_file_and_line(tmp_path, line, message):
    lines = CACHE.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3] + [line] + lines[3:]) + "\n")
    with pytest.raises(ArtifactError, match="^" + str(bad).replace(".", r"\.") + ": " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        read_artifact(bad)


def test_header_without_tuner_version_is_refused():
    with pytest.raises(ArtifactError, match=r"^t\.jsonl: line 1: the header has no \"tuner_version\""):
        read_tuning_cache('{"searching_algorithm":"fast"}\n{"iter":0,"build_route":""}\n', "t.jsonl")


def test_inspect_table_marks_the_best_route(capsys):
    assert main(["inspect", str(CACHE)]) == 0
    out = capsys.readouterr().out
    best_row = next(line for line in out.splitlines() if "best" in line and "-kgen:tiling=1" in line)
    assert "1.6127" in best_row and "0.0031" in best_row and "0.0017" in best_row
    assert "over accuracy budget" in out and "crashed: child trtexec exited with signal 11 (SIGSEGV)" in out
    assert "Best route: iteration 2, 1.6127 ms: -kgen:tiling=1" in out
    assert "1.14x the default route's speed (1.8421 ms, iteration 0)" in out


def test_inspect_json_schema(capsys):
    assert main(["inspect", str(CACHE), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "trt-tuning-cache" and doc["best"] == {"iter": 2, "build_route": "-kgen:tiling=1",
                                                                  "gpu_time_ms": 1.6127}
    assert doc["default_build_route_knobs"] == 4 and doc["num_iterations"] == 6 == len(doc["iterations"])
    row = doc["iterations"][4]
    assert set(row) == {"iter", "build_route", "status", "crash", "error_message", "gpu_time_ms", "accuracy_loss",
                        "max_accuracy_loss", "best", "trade_off"}
    assert (row["status"], row["best"], row["trade_off"]) == ("over accuracy budget", False, True)
    assert [r["iter"] for r in doc["iterations"] if r["best"]] == [2]


def test_other_commands_refuse_a_tuning_cache_with_a_hint(capsys):
    assert main(["lint", str(CACHE)]) == 2
    assert "this is a TensorRT tuning cache, not an engine description; `kiln inspect" in capsys.readouterr().err


def test_inspect_malformed_cache_exits_2_naming_file_and_line(capsys, tmp_path):
    bad = tmp_path / "cut.jsonl"
    bad.write_text(CACHE.read_text() + '{"iter":6,"build_route":"-kgen:til')   # an interrupted run's last line
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 8: not valid JSON" in err and "partial last line" in err
