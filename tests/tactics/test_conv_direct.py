"""kiln's direct convolution (kiln.tactics.conv_direct on gemm_c.kiln_conv): every kernel size, stride and
padding it takes matches float64, windows crossing every border included; it writes into a donated residual
exactly as into a fresh buffer; it declines what it cannot run; a model forced onto source "kiln" runs its
non-1x1 convolutions on it and matches onnxruntime."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.tactics import codegen
from kiln.tactics.conv_direct import DIRECT_TACTIC, DirectConvTactic
from tests.tactics.forced import build_forced_onto
from tests.tactics.test_conv1x1 import check_donated_residual, conv_view, inputs

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")


def reference(view, xs):
    a, bias = view.attrs, view.const_inputs.get(2)
    pt, pl, pb, pr = a["pads"]
    x = F.pad(xs[0].double(), (pl, pr, pt, pb))
    y = F.conv2d(x, view.const_inputs[1].double(), None if bias is None else bias.double(), stride=a["strides"])
    if len(xs) > 3:
        y = y + xs[3].double()
    op = (a.get("activation") or {}).get("op")
    return {"Relu": y.relu(), "Sigmoid": y.sigmoid(), "Swish": y * y.sigmoid()}.get(op, y)


CASES = [  # c, cout, h, w, stride, kernel, pads, batch, residual, activation
    (64, 64, 20, 20, 2, 3, (1, 1, 1, 1), 1, False, "Relu"),    # ResNet's strided 3x3
    (3, 40, 31, 29, 2, 7, (3, 3, 3, 3), 1, False, "Relu"),     # the 7x7 stem: 21-float segments, wide borders
    (32, 70, 7, 7, 1, 3, (1, 1, 1, 1), 2, True, "Relu"),       # 7x7 maps, batch 2, residual, a partial panel
    (16, 24, 9, 12, 1, 5, (2, 1, 0, 3), 1, False, None),       # asymmetric pads, 5x5, no activation
    (8, 33, 6, 5, 3, 3, (0, 0, 0, 0), 1, False, "Sigmoid"),    # no padding, stride 3, an activation after
    (24, 16, 10, 10, 1, 1, (1, 1, 1, 1), 1, False, "Relu"),    # a padded 1x1: the border rows are all zeros
    (5, 7, 4, 4, 1, 3, (1, 1, 1, 1), 1, False, "Relu"),        # fewer rows than a chunk, channels not a vector
    (16, 32, 20, 20, 2, 3, (1, 1, 1, 1), 1, False, "Swish"),   # YOLO's strided 3x3 with SiLU in the store
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}s{c[4]}k{c[5]}n{c[7]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_convolution(case, threads):
    c, cout, h, w, stride, kernel, pads, n, residual, activation = case
    view = conv_view(c, cout, h, w, stride, n, True, residual, activation, kernel=kernel, pads=pads)
    tactic = DirectConvTactic()
    assert tactic.supports(view)
    xs = inputs(view)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = tactic.prepare(view)(xs)[0]
    finally:
        torch.set_num_threads(previous)
    want = reference(view, xs)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 2e-6, err


def test_donated_residual_is_overwritten_with_the_same_result():
    view = conv_view(32, 70, 7, 7, n=2, residual=True, kernel=3, pads=(1, 1, 1, 1))
    check_donated_residual(DirectConvTactic().prepare(view), inputs(view))


@pytest.mark.parametrize("change", [dict(kernel=1), dict(group=2, kernel=3), dict(dynamic=(2,), kernel=3),
                                    dict(kernel=3, residual=True, residual_shape=(1, 16, 1, 1))], ids=str)
def test_declines_layers_it_cannot_run(change):
    assert not DirectConvTactic().supports(conv_view(**(dict(c=16, cout=16, h=6, w=6) | change)))


def test_declines_dilation():
    view = conv_view(16, 16, 9, 9, kernel=3)
    view.attrs["dilations"] = [2, 2]
    assert not DirectConvTactic().supports(view)


class Net(nn.Module):
    """A stem, a strided 3x3 with batch norm, a 3x3 with a residual and a 1x1 head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 7, 2, 3)
        self.down = nn.Conv2d(16, 32, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.body = nn.Conv2d(32, 32, 3, 1, 1)
        self.head = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.down(torch.relu(self.stem(x)))))
        return self.head(torch.relu(self.body(y) + y))


def test_model_forced_onto_kiln_matches_onnxruntime(tmp_path):
    torch.manual_seed(0)
    engine = build_forced_onto(Net().eval(), torch.randn(1, 3, 45, 38), tmp_path)
    direct = sorted(l.name.split(" + ")[0] for l in engine.plan.layers if l.tactic_name == DIRECT_TACTIC)
    assert "/stem/Conv" in direct and "/down/Conv" in direct, direct
