"""PaddingConvFusion on IR graphs: a zero Pad around H and W before a convolution (Keras' ZeroPadding2D, tf2onnx's
explicit SAME padding) becomes the convolution's own pads, added to the ones it has; every near miss says why it
did not fuse. The end-to-end check against onnxruntime is in tests/passes/test_pad_conv.py."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.conv import fold_pad_into_conv
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

CONV = {"kernel_shape": [3, 3], "strides": [2, 2], "dilations": [1, 1], "group": 1}


def pad_conv(pads, conv_pads=(0, 0, 0, 0), mode=None, value=None, axes=None, **conv_attrs):
    """x [1,3,8,8] -> Pad(pads[, value][, axes]) -> Conv 3x3 s2 -> y; names are output names."""
    b = IRBuilder()
    x = b.input("x", (1, 3, 8, 8))
    inputs = [x, b.const("pads", pads, np.int64)]
    if value is not None or axes is not None:
        inputs.append(None if value is None else b.const("value", value))
    if axes is not None:
        inputs.append(b.const("axes", axes, np.int64))
    widths = dict(zip(range(4), zip(pads[:4], pads[4:]))) if axes is None else \
        {a: (pads[i], pads[i + len(axes)]) for i, a in enumerate(axes)}
    padded = tuple(d + sum(widths.get(a, (0, 0))) for a, d in enumerate((1, 3, 8, 8)))
    p = b.node("Pad", inputs, "p", padded, **({"mode": mode} if mode else {}))
    out = tuple((padded[2 + i] + conv_pads[i] + conv_pads[2 + i] - 3) // 2 + 1 for i in (0, 1))
    y = b.node("Conv", [p, b.const("w", np.ones((4, 3, 3, 3))), b.const("b", np.zeros(4))], "y", (1, 4, *out),
               **CONV, pads=list(conv_pads), **conv_attrs)
    return b.graph(y)


def test_keras_zero_padding_becomes_the_convolutions_pads():
    g = pad_conv([0, 0, 3, 3, 0, 0, 3, 3])   # ResNet50's conv1 in Keras: ZeroPadding2D(3) then a valid 7x7/2 (here 3x3)

    run = run_pass(g, "PaddingConvFusion", fold_pad_into_conv)

    assert str(g) == expected("""
        graph g(%x: float32[1x3x8x8]):
          %y: float32[1x4x6x6] = Conv(%x, const %w, const %b) dilations=[1, 1] group=1 kernel_shape=[3, 3] pads=[3, 3, 3, 3] strides=[2, 2]  # p + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "PaddingConvFusion: Fusing p with y" in run.lines


def test_asymmetric_same_padding_adds_to_the_convolutions_own():
    g = pad_conv([0, 0, 0, 0, 0, 0, 1, 1], conv_pads=(1, 1, 0, 0), padding_mode="SAME_UPPER")

    run_pass(g, "PaddingConvFusion", fold_pad_into_conv)

    conv, = g.nodes
    assert conv.attrs["pads"] == [1, 1, 1, 1] and "padding_mode" not in conv.attrs   # explicit pads now
    assert conv.inputs[0].name == "x" and conv.name == "p + y"


def test_opset18_axes_pad_only_the_axes_named():
    g = pad_conv([1, 2, 0, 1], value=0.0, axes=[2, 3])   # H by (1, 0), W by (2, 1)

    run_pass(g, "PaddingConvFusion", fold_pad_into_conv)

    assert g.nodes[0].attrs["pads"] == [1, 2, 0, 1]


@pytest.mark.parametrize("kwargs, reason", [
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "reflect"}, "p pads in mode 'reflect', not with a constant"),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "value": 1.5}, "p pads with 1.5, not 0"),
    ({"pads": [0, 1, 1, 1, 0, 0, 1, 1]}, "p pads the batch or channel axis"),
    ({"pads": [0, 0, -1, 1, 0, 0, 1, 1]}, "p crops (a negative pad)"),
])
def test_near_misses_say_why(kwargs, reason):
    g = pad_conv(**kwargs)
    run = run_pass_unchanged(g, "PaddingConvFusion", fold_pad_into_conv)
    assert run.not_fusing == [f"PaddingConvFusion: Not fusing p with y: {reason}"]


def test_a_pad_read_elsewhere_stays():
    b = IRBuilder()
    x = b.input("x", (1, 3, 8, 8))
    p = b.node("Pad", [x, b.const("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64)], "p", (1, 3, 10, 10))
    y = b.node("Conv", [p, b.const("w", np.ones((4, 3, 3, 3)))], "y", (1, 4, 8, 8), **CONV | {"strides": [1, 1]},
               pads=[0, 0, 0, 0])
    g = b.graph(y, p)

    run = run_pass(g, "PaddingConvFusion", fold_pad_into_conv)

    assert [n.op_type for n in g.nodes] == ["Pad", "Conv"]
    assert run.not_fusing == ["PaddingConvFusion: Not fusing p with y: p's output 'p' is a network output"]
