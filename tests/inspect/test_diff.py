"""Diff on hand-built engines (matching, precision/tactic changes, fused groups, latency ranking) and on the real
TensorRT fixtures (names-only vs detailed dumps of the same engine)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kiln.inspect.diff import diff, match_layers
from kiln.trt.records import EngineInfo, LayerRecord, Profile, ProfileRecord, TensorInfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
I8 = "Thirty-two wide channel vectorized row major Int8 format"
FP16 = "Row major linear FP16 format"
FP32 = "Row major linear FP32"


def lay(name, inp="x", out="y", fmt=FP16, tactic="sm80_hmma_a", origin=None, layer_type="CaskConvolution",
        dims=(1, 64, 8, 8)):
    return LayerRecord(name, layer_type, "Convolution", (TensorInfo(inp, dims, fmt),), (TensorInfo(out, dims, fmt),),
                       {}, tactic, "0x1", tuple(origin if origin is not None else [name]))


def engine(*layers, verbosity="detailed"):
    return EngineInfo("test", verbosity, tuple(layers))


def profile(times: dict[str, float]) -> Profile:
    return Profile(1, tuple(ProfileRecord(n, v, v, v, 0.0) for n, v in times.items()))


def test_matching_order_origin_then_name_then_type_shape():
    a = engine(lay("conv1 + relu1", origin=["conv1", "relu1"]), lay("pool"), lay("(Unnamed Layer* 7) [Shuffle]",
               origin=[], layer_type="NoOp", dims=(1, 10)))
    b = engine(lay("conv1_relu1_fused", origin=["relu1", "conv1"]), lay("pool", origin=[]),
               lay("(Unnamed Layer* 9) [Shuffle]", origin=[], layer_type="NoOp", dims=(1, 10)))
    d = diff(a, b)
    assert d.pairs == (("conv1 + relu1", "conv1_relu1_fused", "origin"), ("pool", "pool", "name"),
                       ("(Unnamed Layer* 7) [Shuffle]", "(Unnamed Layer* 9) [Shuffle]", "type+shape"))
    assert d.only_a == d.only_b == () and d.layer_count_a == d.layer_count_b == 3
    assert match_layers(a, b) == [(0, 0, "origin"), (1, 1, "name"), (2, 2, "type+shape")]


def test_precision_change():
    d = diff(engine(lay("c1", fmt=I8), lay("c2")), engine(lay("c1", fmt=FP32), lay("c2")))
    assert [(c.layer_a, c.kind, c.a, c.b) for c in d.changes] == [("c1", "precision", "INT8", "FP32")]
    assert any("1 precision" in s for s in d.explanation)


def test_tactic_change_and_format_only_change():
    a = engine(lay("c1", tactic="sm80_xmma_fprop_hmma_a"), lay("c2", fmt="Channel major FP16 format with 8 channels"))
    b = engine(lay("c1", tactic="sm70_fprop_simt"), lay("c2"))
    d = diff(a, b)
    kinds = {(c.layer_a, c.kind) for c in d.changes}
    assert kinds == {("c1", "tactic"), ("c2", "format")}
    assert [c.b for c in d.changes if c.kind == "tactic"] == ["sm70_fprop_simt"]


def test_fused_group_difference():
    a = engine(lay("conv + bn + relu", origin=["conv", "bn", "relu"]), lay("pool"))
    b = engine(lay("conv + bn", origin=["conv", "bn"]), lay("relu", layer_type="CaskPointwise"), lay("pool"))
    d = diff(a, b)
    [g] = d.fused_groups_differ
    assert g.layers_a == ("conv + bn + relu",) and g.layers_b == ("conv + bn", "relu")
    assert set(g.origins) == {"conv", "bn", "relu"}
    # the conv layers still pair (same type and shape, overlapping origins); the split-off relu is only in B
    assert ("conv + bn + relu", "conv + bn", "type+shape") in d.pairs and d.only_b == ("relu",)
    assert not diff(a, a).fused_groups_differ


def test_latency_ranking_with_profiles_counts_unmatched_layers_fully():
    a = engine(lay("c1", fmt=I8), lay("c2"), lay("c3"), lay("gone"))
    b = engine(lay("c1", fmt=FP32), lay("c2"), lay("c3"), lay("new"))
    pa = profile({"c1": 0.10, "c2": 0.50, "c3": 0.30, "gone": 0.05})
    pb = profile({"c1": 0.90, "c2": 0.52, "c3": 0.30, "new": 0.40})
    d = diff(a, b, pa, pb)
    assert d.total_ms_a == pytest.approx(0.95) and d.total_ms_b == pytest.approx(2.12)
    tail = d.explanation[d.explanation.index(next(s for s in d.explanation if s.startswith("Total"))) + 1:]
    assert tail[0].startswith("+0.800 ms: c1") and "precision INT8 -> FP32" in tail[0]
    assert tail[1].startswith("+0.400 ms: new only in B")
    assert len(tail) <= 3 and not any("c3" in s for s in tail)
    assert ("gone" in d.only_a) and ("new" in d.only_b)       # disjoint origins: never paired by type+shape
    assert diff(a, b).total_ms_a is None


def test_identical_engines_and_json_serialisable():
    e = engine(lay("c1"), lay("c2"))
    d = diff(e, e)
    assert d.changes == () and "No layer differences found." in d.explanation and not d.verbosity_only
    assert dataclasses.asdict(d)["pairs"][0] == ("c1", "c1", "origin")


def test_region_vs_sub_layers_by_data_flow():
    region = LayerRecord("{ForeignNode[/a/MatMul.../a/Add]}", "Myelin", None, (TensorInfo("x", (1, 8), "Half"),),
                         (TensorInfo("y", (1, 8), "Half"),))
    subs = [lay("/a/MatMul", "x", "t", layer_type="CaskGemm"), lay("/a/Add", "t", "y", layer_type="CaskPointwise")]
    d = diff(engine(region, verbosity="layer_names_only"), engine(*subs))
    assert d.verbosity_only and any("verbosity, not the engine" in s and "2 sub-layers" in s for s in d.explanation)
    unrelated = [lay("/b/Conv", "p", "q"), lay("/b/Relu", "q", "r")]
    assert not diff(engine(region, verbosity="layer_names_only"), engine(*unrelated)).verbosity_only


# --- the real fixtures, through the readers -------------------------------------------------------------------------

def _read(name):
    readers = pytest.importorskip("kiln.trt.artifacts")
    return readers.read_artifact(FIXTURES / name)


def test_fixture_bert_names_only_vs_detailed_explains_verbosity():
    names = _read("bert_fp16_trt10.10_names_only.oneline.log")
    detailed = _read("bert_fp16_trt10.10_detailed.oneline.log")
    for a, b, coarse, fine in ((names, detailed, "A", "B"), (detailed, names, "B", "A")):
        d = diff(a, b)
        assert d.verbosity_only
        assert len(d.pairs) == 1 and d.pairs[0][0].startswith("Reformatting CopyNode for Output Tensor 0")
        assert d.changes == ()
        line = next(s for s in d.explanation if "verbosity" in s)
        assert f"{coarse} lists the Myelin region {{ForeignNode[" in line and f"{fine} lists its 88 sub-layers" in line
    assert {d.layer_count_a, d.layer_count_b} == {2, 89}


def test_fixture_resnet18_names_only_vs_detailed_matches_all_by_name():
    d = diff(_read("resnet18_trt10_names_only.layers.json"), _read("resnet18_trt10_detailed.layers.json"))
    assert len(d.pairs) == 25 and all(a == b and how == "name" for a, b, how in d.pairs)
    assert d.only_a == d.only_b == () and d.changes == () and not d.verbosity_only
    assert any("names only" in s for s in d.explanation)


def test_fixture_resnet18_detailed_vs_itself():
    e = _read("resnet18_trt10_detailed.layers.json")
    d = diff(e, e)
    assert len(d.pairs) == 25 and d.changes == () and d.fused_groups_differ == ()
