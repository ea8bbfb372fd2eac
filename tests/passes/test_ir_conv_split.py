"""ConvSliceSplit on IR graphs: a convolution read only through channel Slices or a channel Split (YOLO's C2f
chunk) becomes one convolution per slice, with its rows of the weights and bias; every near miss says why. The
end-to-end check against onnxruntime closes the file."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.passes.conv_split import split_sliced_convs
from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

CONV = {"kernel_shape": [1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1, "pads": [0, 0, 0, 0]}


def sliced_conv(ranges=((0, 4), (4, 8)), split=False, group=1, extra_reader=None, steps=None, axes=(1,)):
    """x [1,3,5,5] -> 1x1 Conv (8 channels, SiLU fused) -> Slices of `ranges` (or one Split), names = outputs."""
    b = IRBuilder()
    x = b.input("x", (1, 3, 5, 5) if group == 1 else (1, 8, 5, 5))
    w = np.arange(8 * (3 if group == 1 else 8 // group), dtype=np.float32).reshape(8, -1, 1, 1)
    y = b.node("Conv", [x, b.const("w", w), b.const("b", np.arange(8, dtype=np.float32))], "y", (1, 8, 5, 5),
               **{**CONV, "group": group}, activation={"op": "Swish", "attrs": {}})
    if split:
        outs = b.multi("Split", [y, b.const("sizes", [r[1] - r[0] for r in ranges], np.int64)],
                       [(f"s{i}", (1, r[1] - r[0], 5, 5)) for i, r in enumerate(ranges)], name="split", axis=1)
    else:
        outs = [b.node("Slice", [y, b.const(f"st{i}", [r[0]] + [0] * (len(axes) - 1), np.int64),
                                 b.const(f"en{i}", [r[1]] + [5] * (len(axes) - 1), np.int64),
                                 b.const(f"ax{i}", list(axes), np.int64),
                                 *([b.const(f"sp{i}", [steps], np.int64)] if steps else [])],
                       f"s{i}", (1, r[1] - r[0], 5, 5)) for i, r in enumerate(ranges)]
    if extra_reader:
        outs.append(b.node(extra_reader, [y], "r", (1, 8, 5, 5)))
    return b.graph(*outs)


def test_two_channel_slices_become_two_convolutions_of_their_channels():
    g = sliced_conv()

    run = run_pass(g, "ConvSliceSplit", split_sliced_convs)

    assert str(g) == expected("""
        graph g(%x: float32[1x3x5x5]):
          %s0: float32[1x4x5x5] = Conv(%x, const %y + s0.weight, const %y + s0.bias) activation={'op': 'Swish', 'attrs': {}} dilations=[1, 1] group=1 kernel_shape=[1, 1] pads=[0, 0, 0, 0] strides=[1, 1]  # y + s0
          %s1: float32[1x4x5x5] = Conv(%x, const %y + s1.weight, const %y + s1.bias) activation={'op': 'Swish', 'attrs': {}} dilations=[1, 1] group=1 kernel_shape=[1, 1] pads=[0, 0, 0, 0] strides=[1, 1]  # y + s1
          return %s0, %s1
        """)
    first, second = g.nodes
    np.testing.assert_array_equal(first.inputs[1].const.reshape(4, 3), np.arange(12).reshape(4, 3))
    np.testing.assert_array_equal(second.inputs[2].const, [4, 5, 6, 7])
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert "ConvSliceSplit: Fusing y with s0" in run.lines


def test_a_split_gives_one_convolution_per_output_and_unread_channels_are_not_computed():
    g = sliced_conv(ranges=((0, 2), (2, 8)), split=True)
    run_pass(g, "ConvSliceSplit", split_sliced_convs)
    assert [(n.name, n.outputs[0].name, n.inputs[1].const.shape[0]) for n in g.nodes] == \
        [("y + split [0]", "s0", 2), ("y + split [1]", "s1", 6)]

    g = sliced_conv(ranges=((2, 5),))   # one slice: channels 0-1 and 5-7 are dead
    run_pass(g, "ConvSliceSplit", split_sliced_convs)
    np.testing.assert_array_equal(g.nodes[0].inputs[2].const, [2, 3, 4])


@pytest.mark.parametrize("kwargs, reason", [
    ({"ranges": ((0, 5), (4, 8))}, "the slices of y's output overlap: its channels would be computed twice"),
    ({"steps": 2, "ranges": ((0, 8),)}, "s0 does not take constant, unit-step channel ranges"),
    ({"group": 2}, "y is grouped, adds a residual or has computed weights"),
    ({"axes": (1, 2)}, "s0 does not take constant, unit-step channel ranges"),   # H whole only at the probe shape
    ({"ranges": tuple((i, i + 1) for i in range(5))}, "y's output is read in 5 slices: each would read the whole "
                                                      "input again"),
])
def test_near_misses_say_why(kwargs, reason):
    g = sliced_conv(**kwargs)
    run = run_pass_unchanged(g, "ConvSliceSplit", split_sliced_convs)
    assert run.not_fusing == [f"ConvSliceSplit: Not fusing y with s0: {reason}"]


def test_a_split_whose_sizes_are_computed_stays():
    """Split sizes known only at run time (an input here) are not taken for equal halves."""
    b = IRBuilder()
    x, sizes = b.input("x", (1, 3, 5, 5)), b.input("sizes", (2,), np.int64)
    y = b.node("Conv", [x, b.const("w", np.ones((8, 3, 1, 1)))], "y", (1, 8, 5, 5), **CONV)
    g = b.graph(*b.multi("Split", [y, sizes], [("s0", (1, 4, 5, 5)), ("s1", (1, 4, 5, 5))], name="split", axis=1))
    run = run_pass_unchanged(g, "ConvSliceSplit", split_sliced_convs)
    assert run.not_fusing == ["ConvSliceSplit: Not fusing y with split: split does not take constant, unit-step "
                              "channel ranges"]


def test_a_convolution_also_read_whole_stays():
    g = sliced_conv(extra_reader="Relu")
    run = run_pass_unchanged(g, "ConvSliceSplit", split_sliced_convs)
    assert run.not_fusing == []   # not a candidate at all: no line


def c2f_head() -> bytes:
    """A YOLOv8 C2f's start: Conv+BN+SiLU, its output chunked by two Slices, a 3x3 conv on the second, a Concat."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="cv1"),
             helper.make_node("BatchNormalization", ["c", "g", "be", "mu", "var"], ["bn"], name="bn"),
             helper.make_node("Sigmoid", ["bn"], ["sig"], name="sig"),
             helper.make_node("Mul", ["bn", "sig"], ["a"], name="silu"),
             helper.make_node("Slice", ["a", "z", "h", "one"], ["s0"], name="chunk0"),
             helper.make_node("Slice", ["a", "h", "big", "one"], ["s1"], name="chunk1"),
             helper.make_node("Conv", ["s1", "w2"], ["m"], name="m0", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["s0", "s1", "m"], ["y"], name="cat", axis=1)]
    inits = [init("w1", rand((16, 8, 1, 1), seed=1) * 0.3), init("g", rand((16,), seed=2) * 0.1 + 1),
             init("be", rand((16,), seed=3) * 0.1), init("mu", rand((16,), seed=4) * 0.1),
             init("var", np.abs(rand((16,), seed=5)) + 0.5), init("w2", rand((8, 8, 3, 3), seed=6) * 0.1),
             init("z", np.array([0], np.int64)), init("h", np.array([8], np.int64)),
             init("big", np.array([2 ** 62], np.int64)), init("one", np.array([1], np.int64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def test_a_c2f_chunk_runs_as_two_convolutions_and_matches_onnxruntime():
    model = c2f_head()
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime")
    layers = {l.name: l for l in engine.plan.layers}
    assert "cv1 + bn + sig + silu + chunk0" in layers and "cv1 + bn + sig + silu + chunk1" in layers
    assert not [l for l in engine.plan.layers if l.op_type == "Slice"]
    x = rand((1, 8, 12, 12), seed=7)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert cosine(got, want) > 0.99999
