"""Dynamic shapes: optimization profiles (min/opt/max per input), any shape inside runs correctly, outside is a
clear error, layer info shows -1 for dynamic axes, profiles survive serialization and the CLI takes them."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kiln
from kiln.errors import InputError, ModelError
from tests.conftest import assert_close_to_ort, run_ort

SEQ_PROFILE = {"ids": ((1, 4), (2, 16), (4, 64)), "mask": ((1, 4), (2, 16), (4, 64))}


class TinyEncoder(torch.nn.Module):
    """Embedding, fused QKV projection split into heads, masked softmax attention, residual + LayerNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, 64)
        self.qkv, self.o, self.ln = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)

    def forward(self, ids, mask):
        x = self.emb(ids)
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, 4, 16).transpose(1, 2) for z in self.qkv(x).split(64, -1))
        scores = q @ k.transpose(-1, -2) / 4.0 + (1 - mask[:, None, None, :]) * -1e4
        a = torch.softmax(scores, -1) @ v
        return self.ln(x + self.o(a.transpose(1, 2).reshape(b, t, d)))


@pytest.fixture(scope="module", params=["legacy", "dynamo"])
def encoder_onnx(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("dyn") / f"encoder_{request.param}.onnx"
    ids, mask = torch.randint(0, 100, (2, 16)), torch.ones(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if request.param == "legacy":
            axes = {0: "batch", 1: "seq"}
            torch.onnx.export(TinyEncoder().eval(), (ids, mask), str(path), input_names=["ids", "mask"],
                              output_names=["y"], dynamic_axes={"ids": axes, "mask": axes}, dynamo=False,
                              opset_version=17)
        else:
            dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", max=128)}
            torch.onnx.export(TinyEncoder().eval(), (ids, mask), str(path), input_names=["ids", "mask"],
                              output_names=["y"], dynamic_shapes={"ids": dims, "mask": dims}, dynamo=True,
                              verbose=False)
    return str(path)


def feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.float32)
    mask[:, seq - seq // 4:] = 0   # padded tail
    return {"ids": rng.integers(0, 100, (batch, seq)).astype(np.int64), "mask": mask}


@pytest.mark.parametrize("autotune", [False, True])
def test_one_engine_runs_every_shape_in_its_profile(encoder_onnx, autotune):
    engine = kiln.build(encoder_onnx, profiles=[SEQ_PROFILE], autotune=autotune)
    assert [t.dynamic for t in engine.plan.inputs] == [(0, 1), (0, 1)]
    for batch, seq in [(2, 16), (1, 4), (4, 64), (3, 37), (1, 63)]:
        f = feeds(batch, seq)
        assert_close_to_ort(engine.run(f)["y"], run_ort(encoder_onnx, f)[0])


def test_shape_outside_profile_names_input_shape_and_range(encoder_onnx):
    engine = kiln.build(encoder_onnx, profiles=[SEQ_PROFILE], autotune=False)
    with pytest.raises(InputError, match=r"input 'ids': shape \[1, 65\] is outside the engine's optimization "
                                         r"profile \(profile 0: \[1\.\.4, 4\.\.64\]\)"):
        engine.run(feeds(1, 65))
    with pytest.raises(InputError, match="'ids'.*shape \\[5, 8\\]"):
        engine.run(feeds(5, 8))


def test_layer_info_shows_minus_one_for_dynamic_axes_and_profiles_survive_save(encoder_onnx, tmp_path):
    engine = kiln.build(encoder_onnx, profiles=[SEQ_PROFILE], autotune=False)
    info = engine.layer_info("detailed")
    first = info["Layers"][0]
    assert first["Inputs"][0]["Dimensions"] == [-1, -1]
    assert info["Layers"][-1]["Outputs"][0]["Dimensions"] == [-1, -1, 64]
    resolved = engine.layer_info("detailed", shapes={"ids": (3, 20), "mask": (3, 20)})
    assert resolved["Layers"][-1]["Outputs"][0]["Dimensions"] == [3, 20, 64]
    engine.save(tmp_path / "e.kiln")
    loaded = kiln.load(tmp_path / "e.kiln")
    assert loaded.profiles[0]["ids"].max == (4, 64) and loaded.profiles[0]["mask"].opt == (2, 16)
    f = feeds(3, 20)
    np.testing.assert_array_equal(loaded.run(f)["y"], engine.run(f)["y"])


def test_two_profiles_each_cover_their_range(encoder_onnx):
    small = {"ids": ((1, 1), (1, 8), (1, 16)), "mask": ((1, 1), (1, 8), (1, 16))}
    large = {"ids": ((2, 32), (4, 64), (8, 128)), "mask": ((2, 32), (4, 64), (8, 128))}
    engine = kiln.build(encoder_onnx, profiles=[small, large], autotune=False)
    for batch, seq in [(1, 3), (1, 16), (2, 32), (8, 100)]:
        f = feeds(batch, seq)
        assert_close_to_ort(engine.run(f)["y"], run_ort(encoder_onnx, f)[0])
    with pytest.raises(InputError, match=r"profile 0: \[1, 1\.\.16\]; profile 1: \[2\.\.8, 32\.\.128\]"):
        engine.run(feeds(1, 20))
    ctx = engine.create_execution_context(profile=1)
    with pytest.raises(InputError, match=r"profile 1: \[2\.\.8, 32\.\.128\]"):
        ctx.execute(feeds(1, 3))
    with pytest.raises(InputError, match="optimization profile 2 does not exist"):
        engine.create_execution_context(profile=2)


def test_the_python_api_takes_the_clis_min_opt_max_shapes(encoder_onnx):
    """kiln.build(min_shapes=..., opt_shapes=..., max_shapes=...) as `kiln build --min-shapes ...` takes them; a list
    of specs makes one profile per entry; with profiles= as well it is refused."""
    engine = kiln.build(encoder_onnx, autotune=False, min_shapes=["ids:1x1,mask:1x1", "ids:2x32,mask:2x32"],
                        opt_shapes=["ids:1x8,mask:1x8", "ids:4x64,mask:4x64"],
                        max_shapes=["ids:1x16,mask:1x16", "ids:8x128,mask:8x128"])
    ids = [(r.min, r.opt, r.max) for r in (p["ids"] for p in engine.plan.profiles)]
    assert ids == [((1, 1), (1, 8), (1, 16)), ((2, 32), (4, 64), (8, 128))]
    f = feeds(8, 100)
    assert_close_to_ort(engine.run(f)["y"], run_ort(encoder_onnx, f)[0])
    single = kiln.build(encoder_onnx, autotune=False, min_shapes="ids:1x1,mask:1x1", max_shapes="ids:2x16,mask:2x16")
    (profile,) = single.plan.profiles
    assert (profile["ids"].min, profile["ids"].opt, profile["ids"].max) == ((1, 1), (2, 16), (2, 16))   # opt: max
    with pytest.raises(ModelError, match="either as profiles=.* or as min_shapes/opt_shapes/max_shapes"):
        kiln.build(encoder_onnx, profiles=[{"ids": ((1, 1), (1, 8), (1, 16))}], max_shapes="ids:1x16")


@pytest.mark.parametrize("profile, message", [
    ({"ids": ((1, 16), (1, 8), (1, 32))}, "need min <= opt <= max"),
    ({"idz": ((1, 4), (1, 8), (1, 16))}, r"unknown input\(s\) \['idz'\]"),
    ({"ids": ((1, 4, 1), (1, 8, 1), (1, 16, 1))}, "does not match the model's"),
])
def test_bad_profiles_are_rejected(encoder_onnx, profile, message):
    with pytest.raises(ModelError, match=message):
        kiln.build(encoder_onnx, profiles=[profile], autotune=False)


def test_dynamic_batch_and_resolution_cnn(tmp_path):
    from tests.models.nets import make

    path = tmp_path / "r18.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(make("resnet18"), (torch.randn(2, 3, 64, 64),), str(path), input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "b", 2: "h", 3: "w"}}, dynamo=False)
    profile = {"x": ((1, 3, 32, 32), (2, 3, 64, 64), (3, 3, 96, 96))}
    for sources in ("torch-onednn", "torch"):
        engine = kiln.build(str(path), profiles=[profile], tactic_sources=frozenset({sources}), autotune=False)
        for shape in [(1, 3, 32, 32), (3, 3, 50, 70)]:
            x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
            assert_close_to_ort(engine.run({"x": x})["y"], run_ort(str(path), {"x": x})[0])


def test_trtexec_min_opt_max_shapes_and_run_shapes(encoder_onnx, tmp_path):
    engine, info = tmp_path / "e.kiln", tmp_path / "li.json"
    cmd = [sys.executable, "-m", "kiln.cli.main", "trtexec", f"--onnx={encoder_onnx}", "--minShapes=ids:1x4,mask:1x4",
           "--optShapes=ids:2x16,mask:2x16", "--maxShapes=ids:4x64,mask:4x64", "--shapes=ids:3x40,mask:3x40",
           f"--saveEngine={engine}", f"--exportLayerInfo={info}", "--builderOptimizationLevel=0", "--duration=0",
           "--iterations=2", "--warmUp=0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(info.read_text())["Layers"][0]["Inputs"][0]["Dimensions"] == [3, 40]   # --shapes resolve -1
    assert kiln.load(engine).layer_info()["Layers"][0]["Inputs"][0]["Dimensions"] == [-1, -1]
    bad = subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(engine), "--shapes", "ids:1x70,mask:1x70"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "input 'ids': shape [1, 70] is outside" in bad.stderr + bad.stdout


def test_a_dynamic_batch_runs_on_kilns_own_c_kernels(tmp_path):
    """The common export (only the batch dynamic) keeps kiln's C convolutions and pools: they read the batch per
    call. Before, any dynamic axis sent them to oneDNN or torch."""
    from tests.models.nets import make

    path = tmp_path / "r18.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(make("resnet18"), (torch.randn(1, 3, 64, 64),), str(path), input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    profile = {"x": ((1, 3, 64, 64), (2, 3, 64, 64), (4, 3, 64, 64))}
    engine = kiln.build(str(path), profiles=[profile], tactic_sources="-openvino,-onnxruntime,-torch-onednn,-onednn",
                        autotune=False)
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    pools = [l for l in engine.plan.layers if "Pool" in l.op_type]
    assert len(convs) == 20 and all(l.tactic_name.startswith("kiln.conv2d_") for l in convs)
    assert len(pools) == 2 and all(l.tactic_name == "kiln.pool2d_nhwc" for l in pools)
    for n in (1, 3, 4):
        x = np.random.default_rng(n).standard_normal((n, 3, 64, 64)).astype(np.float32)
        assert_close_to_ort(engine.run({"x": x})["y"], run_ort(str(path), {"x": x})[0])


def test_detailed_layer_info_describes_a_reshape_whose_shape_is_computed_at_run_time():
    """A flat [n * s] tensor reshaped to Concat(Shape(x)[0], 1, 1, Shape(x)[1]) (BERT's attention mask, exported
    with a dynamic batch and length) stays one ONNX Reshape reading its target per inference: no fixed target with
    0 and -1 says it. Detailed layer info once failed on such a layer (it has no fused Shuffle steps)."""
    from onnx import TensorProto, helper

    from tests.conftest import init, make_model

    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"], name="flat"),
             helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="batch"),
             helper.make_node("Gather", ["s", "one"], ["l"], name="length"),
             helper.make_node("Concat", ["n", "ones", "l"], ["target"], name="target", axis=0),
             helper.make_node("Reshape", ["f", "target"], ["r"], name="mask"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "s"])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("flat", np.array([-1], np.int64)), init("zero", np.array([0], np.int64)),
                        init("one", np.array([1], np.int64)), init("ones", np.array([1, 1], np.int64))])
    engine = kiln.build(model, autotune=False, profiles=[{"x": ((1, 2), (2, 8), (4, 16))}])
    reshape = next(l for l in engine.plan.layers if l.name == "mask")
    assert reshape.op_type == "Reshape" and "steps" not in reshape.attrs   # the ONNX op, not a fused Shuffle
    info = next(l for l in engine.layer_info("detailed")["Layers"] if l["Name"] == "mask")
    assert info["ParameterType"] == "Shuffle" and info["Reshape"] == [-1, 1, 1, -1]
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], np.maximum(x.reshape(3, 1, 1, 5), 0))


class FlatRows(torch.nn.Module):
    """[b, t, d] -> [b * t, d] -> Softmax -> [b, t, d]: a decoder's step with the length 1 at the opt point."""

    def forward(self, x):
        b, t, d = x.shape
        return torch.relu(torch.softmax(x.reshape(b * t, d), -1).reshape(b, t, d)) + 1


def test_a_computed_reshape_does_not_copy_an_axis_that_only_matches_at_the_opt_point(tmp_path):
    """At the opt point [2, 1, 8] the merged axis b * t and the batch b are both 2, so a target written from the
    opt shapes alone copied the batch ([0, 8]): [3, 2, 8] then failed and [b, t, d] came back [b * t, 1, d]. The
    importer's probe point tells them apart (8 * 3 against 8), so the axis is inferred (-1)."""
    path = tmp_path / "rows.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(FlatRows(), (torch.randn(2, 1, 8),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "b", 1: "t"}}, dynamo=False)
    engine = kiln.build(str(path), autotune=False, tactic_sources="-openvino,-onnxruntime",
                        profiles=[{"x": ((1, 1, 8), (2, 1, 8), (8, 3, 8))}])
    targets = [l.attrs["steps"] for l in engine.plan.layers if "steps" in l.attrs]
    assert [{"reshape": [-1, 8]}] in targets and [{"reshape": [0, 8]}] not in targets
    back = [l for l in engine.plan.layers if l.name == "/Reshape_1"]   # [b * t, d] -> [b, t, d]: both axes move,
    assert [l.op_type for l in back] == ["Reshape"]                    # so the ONNX op reads its target per call
    for shape in [(2, 1, 8), (3, 2, 8), (8, 3, 8), (1, 1, 8)]:
        x = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32)
        y = engine.run({"x": x})["y"]
        assert y.shape == shape
        assert_close_to_ort(y, run_ort(str(path), {"x": x})[0])


def test_squeeze_and_unsqueeze_keep_h_and_w_apart_in_a_square_profile():
    """H and W have one size at every bound of a square profile, so no shape point tells them apart: Squeeze and
    Unsqueeze targets come from their axes. [N, 1, H, W] -> [N, H, W] cannot be one reshape target (H and W both
    move) and stays a Squeeze; before, it became [0, -1, 0] and a 5x7 image came back 7x5."""
    from onnx import TensorProto, helper

    from tests.conftest import init, make_model

    nodes = [helper.make_node("Squeeze", ["x", "one"], ["s"], name="squeeze"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Unsqueeze", ["r", "one"], ["u"], name="unsqueeze"),
             helper.make_node("Sigmoid", ["u"], ["y"], name="sigmoid"),
             helper.make_node("Unsqueeze", ["x", "last"], ["z"], name="trailing")]   # [N, 1, H, W, 1]: in place
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, "h", "w"])],
                       [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z", "s")],
                       [init("one", np.array([1], np.int64)), init("last", np.array([4], np.int64))])
    engine = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime",
                        profiles=[{"x": ((1, 1, 4, 4), (1, 1, 8, 8), (2, 1, 16, 16))}])
    ops = {l.name: (l.op_type, l.attrs.get("steps")) for l in engine.plan.layers}
    assert ops["squeeze"] == ("Squeeze", None) and ops["trailing"] == ("Shuffle", [{"reshape": [0, 1, 0, 0, 1]}])
    for shape in [(1, 1, 5, 7), (2, 1, 16, 4), (1, 1, 8, 8)]:
        x = np.random.default_rng(shape[2]).standard_normal(shape).astype(np.float32)
        got, want = engine.run({"x": x}), run_ort(model, {"x": x})
        for name, expected in zip(("y", "z", "s"), want):
            assert got[name].shape == expected.shape
            np.testing.assert_allclose(got[name], expected, rtol=1e-6, atol=1e-6)
