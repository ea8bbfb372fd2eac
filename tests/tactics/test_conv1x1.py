"""kiln's own GEMM (kiln.tactics.gemm_c) and the 1x1 convolution tactic on it: every shape it takes matches
float64, partial register tiles and column panels included; it writes into a donated residual exactly as into
a fresh buffer; it declines what it cannot run; a model forced onto source "kiln" matches onnxruntime."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import native
from kiln.tactics import codegen, gemm_c
from kiln.tactics.base import LayerView
from kiln.tactics.conv1x1 import CONV1X1_TACTIC, Conv1x1GemmTactic
from tests.tactics.forced import build_forced_onto

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")


def conv_view(c, cout, h, w, stride=1, n=1, bias=True, residual=False, activation="Relu", kernel=1, pads=(0, 0, 0, 0),
              group=1, residual_shape=None, dynamic=()):
    g = torch.Generator().manual_seed(c * 1000 + cout)
    weight = torch.randn(cout, c // group, kernel, kernel, generator=g) * (2 / c) ** 0.5
    consts = {1: weight}
    if bias:
        consts[2] = torch.randn(cout, generator=g) * 0.1
    attrs = {"pads": list(pads), "strides": [stride] * 2, "dilations": [1, 1], "group": group}
    if activation:
        attrs["activation"] = {"op": activation, "attrs": {}}
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    shapes = [(n, c, h, w), tuple(weight.shape), (cout,) if bias else None]
    if residual:
        shapes.append(residual_shape or (n, cout, oh, ow))
    dyn = (tuple(dynamic),) + ((),) * 2 + ((tuple(dynamic),) if residual else ())   # `dynamic`: input 0's axes
    return LayerView("Conv", "", attrs, tuple(shapes), tuple("float32" if s else None for s in shapes), consts,
                     input_dynamic=dyn)


def channels_last(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).contiguous(
        memory_format=torch.channels_last)


def inputs(view, seed=1):
    xs = [channels_last(*view.input_shapes[0], seed=seed), None, None]
    if len(view.input_shapes) > 3:
        xs.append(channels_last(*view.input_shapes[3], seed=seed + 1))
    return xs


def reference(view, xs):
    a, bias = view.attrs, view.const_inputs.get(2)
    y = F.conv2d(xs[0].double(), view.const_inputs[1].double(), None if bias is None else bias.double(),
                 stride=a["strides"])
    if len(xs) > 3:
        y = y + xs[3].double()
    op = (a.get("activation") or {}).get("op")
    return {"Relu": y.relu(), "Sigmoid": y.sigmoid(), "Swish": y * y.sigmoid()}.get(op, y)


CASES = [  # c, cout, h, w, stride, batch, bias, residual, activation
    (64, 256, 56, 56, 1, 1, True, True, "Relu"),     # a ResNet-50 bottleneck's last layer
    (256, 512, 56, 56, 2, 1, True, False, None),     # strided downsample: rows read in place (row chunks outermost)
    (520, 264, 10, 6, 1, 2, True, True, "Relu"),     # weights over ROWS_OUTER_BYTES: column panels outermost
    (3, 5, 7, 9, 1, 1, True, False, "Relu"),         # fewer rows than one register tile, one partial panel
    (40, 33, 13, 11, 1, 2, False, True, "Relu"),     # batch 2, no bias, 33 = a whole panel + 1 column
    (48, 80, 9, 7, 2, 3, True, True, None),          # odd maps with stride 2: per-image rows
    (16, 24, 5, 5, 1, 1, True, False, "Sigmoid"),    # Sigmoid in the store (test_gemm_activations: the others)
    (48, 70, 9, 9, 1, 1, True, True, "Swish"),       # SiLU in the store (a partial panel takes the scalar path)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}s{c[4]}n{c[5]}")
def test_matches_float64_convolution(case):
    c, cout, h, w, stride, n, bias, residual, activation = case
    view = conv_view(c, cout, h, w, stride, n, bias, residual, activation)
    tactic = Conv1x1GemmTactic()
    assert tactic.supports(view)
    xs = inputs(view)
    got = tactic.prepare(view)(xs)[0]
    want = reference(view, xs)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 2e-6, err


def check_donated_residual(kernel, xs):
    """The in-place variant (over input 3, the residual) writes into the residual's own buffer exactly what a
    fresh output gets: the C code reads each residual element before it overwrites it."""
    index, into = kernel.into_input
    fresh = kernel(xs)[0]
    donated = xs[3].clone(memory_format=torch.channels_last)
    got = into([xs[0], None, None, donated])[0]
    assert index == 3 and got.data_ptr() == donated.data_ptr() and torch.equal(got, fresh)


def test_donated_residual_is_overwritten_with_the_same_result():
    view = conv_view(40, 33, 13, 11, n=2, residual=True)
    check_donated_residual(Conv1x1GemmTactic().prepare(view), inputs(view))
    assert not hasattr(Conv1x1GemmTactic().prepare(conv_view(8, 8, 4, 4)), "into_input")


@pytest.mark.parametrize("change", [dict(kernel=3, pads=(1, 1, 1, 1)), dict(pads=(1, 1, 1, 1)), dict(group=2),
                                    dict(dynamic=(2, 3)), dict(residual=True, residual_shape=(1, 16, 1, 1))],
                         ids=str)
def test_declines_layers_it_cannot_run(change):
    assert not Conv1x1GemmTactic().supports(conv_view(**(dict(c=16, cout=16, h=6, w=6) | change)))


def test_batched_product_with_separate_weights_per_batch():
    """The Winograd use: one [m x k] · [k x n] per batch entry, each with its own packed weights."""
    batch, m, k, n = 5, 23, 19, 70
    a, b = torch.randn(batch, m, k), torch.randn(batch, k, n)
    packed = gemm_c.pack_weights(b)
    assert packed.shape == (batch, 3, k, gemm_c.PANEL)
    c = torch.full((batch, m, n), float("nan"))
    call = gemm_c.GemmCall(packed.data_ptr(), None, a_batch=m * k, row_width=m, col_step=k, b_batch=packed[0].numel(),
                           c_batch=m * n, k=k, n=n)
    native.library("gemm").kiln_gemm(ctypes.addressof(call), a.data_ptr(), c.data_ptr(), None, batch, m)
    torch.testing.assert_close(c, torch.bmm(a, b), rtol=1e-5, atol=1e-5)


class Bottleneck(nn.Module):
    """1x1 convolutions of every flavour: reduce, strided projection, expand with a residual."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 1, 1)
        self.reduce = nn.Conv2d(32, 16, 1)
        self.bn = nn.BatchNorm2d(16)
        self.mid = nn.Conv2d(16, 16, 3, 2, 1)
        self.expand = nn.Conv2d(16, 48, 1, bias=False)
        self.project = nn.Conv2d(32, 48, 1, stride=2)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = torch.relu(self.mid(torch.relu(self.bn(self.reduce(x)))))
        return torch.relu(self.expand(y) + self.project(x))


def test_model_forced_onto_kiln_matches_onnxruntime(tmp_path):
    torch.manual_seed(0)
    engine = build_forced_onto(Bottleneck().eval(), torch.randn(1, 3, 29, 30), tmp_path, autotune=False)
    ones = sorted(l.name.split(" + ")[0] for l in engine.plan.layers if l.tactic_name == CONV1X1_TACTIC)
    assert ones == ["/expand/Conv", "/project/Conv", "/reduce/Conv"], ones


def test_swish_in_the_store_matches_silu_over_the_whole_float_range():
    """The C kernels' SiLU (Cephes' expf inside): within 2e-6 relative of torch's silu from -200 to 200, exact 0
    at 0, NaN in NaN out, on the vector store (32 columns) and the scalar one (a partial panel of 7)."""
    values = torch.cat([torch.linspace(-200, 200, 4001), torch.tensor([0.0, 1e-30, -1e-30, 87.5, -87.5,
                                                                      float("nan")])])
    for n in (32, 7):
        eye = gemm_c.pack_weights(torch.eye(n))   # kept alive: the C code reads it through a raw pointer
        a = values[: values.numel() // n * n].reshape(-1, n)
        m = a.shape[0]
        c = torch.full((m, n), -1.0)
        call = gemm_c.GemmCall(eye.data_ptr(), None, row_width=m, col_step=n, act=gemm_c.Act(2), k=n, n=n)
        native.library("gemm").kiln_gemm(ctypes.addressof(call), a.data_ptr(), c.data_ptr(), None, 1, m)
        want = F.silu(a.double())
        finite = ~a.isnan()
        torch.testing.assert_close(c[finite].double(), want[finite], rtol=2e-6, atol=1e-30)
        assert c[~finite].isnan().all() and (c[a == 0] == 0).all()
