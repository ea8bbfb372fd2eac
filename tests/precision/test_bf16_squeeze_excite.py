"""A squeeze-excite block under --bf16 on kiln's own kernels: the global average (GlobalAveragePool, or the
ReduceMean over H and W that torch.onnx's dynamo exporter writes) and the channel scale (Mul of the channel-major
map by an [N,C,1,1] gate) run in BF16 on tensors stored bf16, with no Reformat between the convolutions."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.precision.test_bf16_moves import channel_major_build, needs_bf16


def squeeze_excite(pool: str) -> bytes:
    """x -> 3x3 conv + ReLU -> a; pool(a) -> g; 1x1 conv + ReLU -> z; 1x1 conv + Sigmoid -> s; a * s -> m;
    1x1 conv(m) -> y."""
    h = helper.make_node
    squeeze = h("GlobalAveragePool", ["a"], ["g"], name="squeeze") if pool == "GlobalAveragePool" else \
        h("ReduceMean", ["a", "hw"], ["g"], name="squeeze", keepdims=1)   # opset 18: axes as an input
    nodes = [h("Conv", ["x", "w1", "b1"], ["a0"], name="conv", pads=[1, 1, 1, 1]), h("Relu", ["a0"], ["a"], name="act"),
             squeeze,
             h("Conv", ["g", "w2", "b2"], ["z0"], name="fc1"), h("Relu", ["z0"], ["z"], name="fc1_act"),
             h("Conv", ["z", "w3", "b3"], ["s0"], name="fc2"), h("Sigmoid", ["s0"], ["s"], name="gate"),
             h("Mul", ["a", "s"], ["m"], name="scale"),
             h("Conv", ["m", "w4", "b4"], ["y"], name="project")]
    inits = [init("w1", rand((48, 16, 3, 3), seed=1) * 0.1), init("b1", rand((48,), seed=2) * 0.1),
             init("w2", rand((12, 48, 1, 1), seed=3) * 0.2), init("b2", rand((12,), seed=4) * 0.1),
             init("w3", rand((48, 12, 1, 1), seed=5) * 0.3), init("b3", rand((48,), seed=6) * 0.1),
             init("w4", rand((40, 48, 1, 1), seed=7) * 0.15), init("b4", rand((40,), seed=8) * 0.1),
             init("hw", np.array([2, 3], np.int64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 24, 24])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=18)


@needs_bf16
@pytest.mark.parametrize("pool", ["GlobalAveragePool", "ReduceMean"])
def test_the_squeeze_and_the_scale_keep_bf16_between_bf16_convolutions(pool):
    model = squeeze_excite(pool)
    engine = channel_major_build(model)
    info = {layer["Name"]: layer for layer in engine.layer_info()["Layers"]}
    # kiln's pool kernel, or torch's mean of the widened map: both BF16, whichever timed faster
    assert info["squeeze"]["TacticName"] in ("kiln.pool2d_nhwc_bf16", "torch.reference_bf16")
    assert info["scale"]["TacticName"] == "codegen.pointwise_c_simd_bf16"
    for name in ("squeeze", "scale"):
        assert (info[name]["RequestedPrecision"], info[name]["GrantedPrecision"]) == ("BF16", "BF16")
        formats = [t["Format/Datatype"] for t in (*info[name]["Inputs"], *info[name]["Outputs"])]
        assert all(f == "Channel major BF16 format" for f in formats), formats
    reformats = [name for name, layer in info.items() if layer["LayerType"] in ("Reformat", "NoOp")]
    assert all("Input Tensor 0 to conv" in name or "Output" in name for name in reformats), reformats
    stored = {t.name: t.dtype for layer in engine.plan.layers for t in (*layer.inputs, *layer.outputs)}
    assert all(stored[name] == "bfloat16" for name in ("a", "g", "s", "m")), stored
    x = rand((1, 16, 24, 24), seed=9)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999
