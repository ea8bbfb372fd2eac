"""Winograd convolution (source "kiln"): every supported shape matches float64 convolution, unsupported layers
are declined, threads do not share scratch state, and whole models forced onto it match onnxruntime."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.winograd import WinogradBf16Tactic, WinogradConvTactic, transform_weights
from tests.conftest import on_threads
from tests.tactics.forced import build_forced_onto
from kiln.trt.vocab import layer_type


def conv_view(c, cout, h, w, pads=(1, 1, 1, 1), bias=True, residual=False, activation=None, kernel=3, stride=1,
              dilation=1, group=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(cout, c // group, kernel, kernel, generator=g) * (2 / (9 * c)) ** 0.5
    consts = {1: weight}
    if bias:
        consts[2] = torch.randn(cout, generator=g) * 0.1
    attrs = {"pads": list(pads), "strides": [stride] * 2, "dilations": [dilation] * 2, "group": group}
    if activation:
        attrs["activation"] = {"op": activation, "attrs": {}}
    out_h, out_w = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    shapes = [(1, c, h, w), tuple(weight.shape), (cout,) if bias else None]
    if residual:
        shapes.append((1, cout, out_h, out_w))
    return LayerView("Conv", "", attrs, tuple(shapes), tuple("float32" if s else None for s in shapes), consts,
                     input_dynamic=((),) * len(shapes))


def reference(view, xs):
    """float64 convolution with the fused residual and activation."""
    a = view.attrs
    pt, pl, pb, pr = a["pads"]
    bias = view.const_inputs.get(2)
    y = F.conv2d(F.pad(xs[0].double(), [pl, pr, pt, pb]), view.const_inputs[1].double(),
                 None if bias is None else bias.double())
    if len(xs) > 3:
        y = y + xs[3].double()
    op = a.get("activation", {}).get("op")
    return {"Relu": y.relu(), "Sigmoid": y.sigmoid(), "Swish": y * y.sigmoid()}.get(op, y)


def channels_last(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).contiguous(
        memory_format=torch.channels_last)


CASES = [  # c, cout, h, w, pads, bias, residual, activation
    (16, 32, 20, 17, (1, 1, 1, 1), True, False, "Relu"),       # partial tiles: cropped output
    (8, 8, 9, 30, (0, 2, 1, 0), False, True, "Relu"),          # asymmetric pads, no bias, residual
    (32, 16, 14, 14, (1, 1, 1, 1), True, True, None),
    (16, 16, 12, 12, (1, 1, 1, 1), True, False, "Sigmoid"),    # activation applied after the kernel
    (24, 40, 15, 13, (1, 1, 1, 1), True, True, "Swish"),       # SiLU applied as tiles are written
    (64, 64, 56, 56, (1, 1, 1, 1), True, True, "Relu"),        # a ResNet stage-1 layer
]


@pytest.mark.parametrize("path", ["c-transforms", "torch-transforms"])
@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[2]}x{c[3]}")
def test_matches_float64_convolution(tile, case, path, monkeypatch):
    """Both implementations of the transforms: compiled C (where a C compiler is) and torch's GEMMs."""
    from kiln.tactics import codegen, winograd

    if path == "torch-transforms":
        monkeypatch.setattr(winograd, "_compiled", lambda m: None)
    elif not codegen.available():
        pytest.skip("no C compiler")
    c, cout, h, w, pads, bias, residual, activation = case
    view = conv_view(c, cout, h, w, pads, bias, residual, activation)
    tactic = WinogradConvTactic(tile)
    assert tactic.supports(view)
    xs = [channels_last(1, c, h, w), None, None]
    if residual:
        xs.append(channels_last(*view.input_shapes[3], seed=2))
    got = tactic.prepare(view)(xs)[0]
    want = reference(view, xs)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < (2e-6 if tile == 2 else 2e-5), err   # F(4,3)'s larger interpolation points cost some precision


BLOCKING_CASES = [  # c, cout, h, w, batch, residual, (tiles per block, column groups) at 1 and at 2 threads
    (64, 80, 64, 64, 1, True, (24, 1), (24, 1)),    # 256 tiles in 11 blocks, one group; 80 = 2 panels + a partial
    (32, 80, 10, 10, 1, False, (9, 1), (9, 2)),     # one block: at 2 threads the columns split, 2 panels + 1 partial
    (256, 64, 10, 10, 2, True, (6, 1), (6, 2)),     # 2.4 MB transformed weights: 6-tile blocks over batch 2
    (256, 288, 10, 10, 1, True, (9, 1), (9, 2)),    # 10.6 MB transformed weights: every tile in one block
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", BLOCKING_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}n{c[4]}")
def test_compiled_blocking_matches_float64(case, threads):
    from kiln.tactics import codegen, winograd

    if not codegen.available():
        pytest.skip("no C compiler")
    c, cout, h, w, n, residual, *blockings = case
    view = conv_view(c, cout, h, w, residual=residual, activation="Relu")
    view = dataclasses.replace(view, input_shapes=((n, c, h, w),) + view.input_shapes[1:3] +
                               (((n, cout, h, w),) if residual else ()))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block, groups, _ = winograd.fused_blocking(winograd._Geometry.of(view, 4), threads)
        kernel = WinogradConvTactic(4).prepare(view)
        xs = [channels_last(n, c, h, w), None, None] + ([channels_last(n, cout, h, w, seed=2)] if residual else [])
        got = kernel(xs)[0]
    finally:
        torch.set_num_threads(previous)
    assert (block, groups) == blockings[threads - 1]
    want = reference(view, xs)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 2e-5, err


def test_weight_transform_round_trips_through_one_tile():
    """U = G g Gᵀ for one 6x6 input tile gives exactly the 4x4 correlation output (checked in float64)."""
    from kiln.tactics.winograd import transforms

    bt, g, at = transforms(4)
    weight, tile = torch.randn(1, 1, 3, 3, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    u = g @ weight[0, 0] @ g.T
    y = at @ (u * (bt @ tile @ bt.T)) @ at.T
    torch.testing.assert_close(y, F.conv2d(tile[None, None], weight)[0, 0], rtol=1e-12, atol=1e-12)
    assert transform_weights(weight.float(), 4).shape == (36, 1, 1)


@pytest.mark.parametrize("change", [dict(stride=2), dict(dilation=2, pads=(2, 2, 2, 2)), dict(group=2),
                                    dict(kernel=5, pads=(2, 2, 2, 2)), dict(h=6, w=6)], ids=str)
def test_declines_layers_it_cannot_run(change):
    args = dict(c=16, cout=16, h=20, w=20) | change
    assert not WinogradConvTactic(4).supports(conv_view(**args))


@pytest.mark.parametrize("tile", [2, 4])
def test_donated_residual_is_overwritten_with_the_same_result(tile):
    from kiln.tactics import codegen

    if not codegen.available():
        pytest.skip("no C compiler")
    from tests.tactics.test_conv1x1 import check_donated_residual

    view = conv_view(16, 24, 13, 11, residual=True, activation="Relu")
    xs = [channels_last(1, 16, 13, 11), None, None, channels_last(*view.input_shapes[3], seed=2)]
    check_donated_residual(WinogradConvTactic(tile).prepare(view), xs)


def test_declines_dynamic_spatial_axes_and_takes_a_dynamic_batch():
    """Tiles are fixed when the kernel is prepared; a dynamic batch only changes how many there are, which the C
    path counts per call (axis 0 once slipped through a truthiness test)."""
    import dataclasses

    view = conv_view(16, 16, 20, 20)
    for axes, taken in [((2, 3), False), ((2,), False), ((0,), True)]:
        dynamic = dataclasses.replace(view, input_dynamic=(axes,) + view.input_dynamic[1:])
        assert WinogradConvTactic(4).supports(dynamic) == taken
    assert WinogradConvTactic(4).supports(view)


def test_threads_do_not_share_scratch_state():
    view = conv_view(32, 32, 28, 28, residual=True, activation="Relu")
    kernel = WinogradConvTactic(4).prepare(view)
    inputs = [[channels_last(1, 32, 28, 28, seed=s), None, None, channels_last(1, 32, 28, 28, seed=s + 100)]
              for s in range(4)]
    serial = [kernel(xs)[0].clone() for xs in inputs]
    results: dict[int, list[torch.Tensor]] = {}

    def work(i):
        results[i] = [kernel(inputs[i])[0].clone() for _ in range(20)]
    on_threads(work, 4)
    for i in range(4):
        for got in results[i]:
            assert torch.equal(got, serial[i])


class Blocks(nn.Module):
    """3x3 stride-1 convolutions of every flavour Winograd takes: bias/no bias, residual, odd sizes."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.a = nn.Conv2d(16, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.b = nn.Conv2d(16, 24, 3, 1, 0)
        self.head = nn.Conv2d(24, 8, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.bn(self.a(x)) + x)
        return self.head(torch.sigmoid(self.b(x)))


def test_model_forced_onto_winograd_matches_onnxruntime(tmp_path, monkeypatch):
    from kiln.tactics.conv_direct import DirectConvTactic

    # source "kiln" also has a direct convolution, which wins these small layers when timed: take it out
    monkeypatch.setattr(DirectConvTactic, "supports", lambda self, layer: False)
    torch.manual_seed(0)
    engine = build_forced_onto(Blocks().eval(), torch.randn(1, 3, 30, 27), tmp_path)
    runners = {l.name.split(" + ")[0]: layer_type(l) for l in engine.plan.layers if l.op_type == "Conv"}
    # the 3-channel stem is nobody's in source "kiln" (torch's kernel backs it); the 1x1 head is kiln's GEMM
    assert sorted(n for n, t in runners.items() if t == "WinogradConvolution") == ["/a/Conv", "/b/Conv"], runners


# ---- FP32 arithmetic, bf16 storage (kiln.conv2d_winograd_f4x4_3x3_nhwc_bf16) --------------------------------------

def _bf16_io_view(x_bf16: bool, out_bf16: bool, res_bf16: bool, c: int, cout: int, hw: int, weight, bias):
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1,
             "activation": {"op": "Relu", "attrs": {}}}
    stored = lambda bf16: "bfloat16" if bf16 else "float32"  # noqa: E731
    shapes = ((2, c, hw, hw), (cout, c, 3, 3), (cout,), (2, cout, hw, hw))
    return LayerView("Conv", "", attrs, shapes, (stored(x_bf16), "float32", "float32", stored(res_bf16)),
                     {1: weight, 2: bias}, (stored(out_bf16),), 17, ((),) * 4)


@pytest.mark.skipif(not (hardware.has_any(hardware.BF16_ISA) and native.available()),
                    reason="BF16 tactics are offered only where the CPU computes BF16 natively (and C builds)")
@pytest.mark.parametrize("x_bf16,out_bf16,res_bf16", [(1, 1, 1), (0, 1, 0), (1, 0, 0), (0, 0, 1), (0, 0, 0)])
def test_bf16_storage_winograd_computes_in_fp32_and_rounds_only_its_output(x_bf16, out_bf16, res_bf16):
    g = torch.Generator().manual_seed(31)
    c, cout, hw = 24, 40, 13                        # partial tiles, a partial column panel
    weight, bias = torch.randn(cout, c, 3, 3, generator=g) * 0.2, torch.randn(cout, generator=g)
    x = torch.randn(2, c, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, cout, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    x, r = (x.bfloat16() if x_bf16 else x), (r.bfloat16() if res_bf16 else r)
    want = torch.relu(F.conv2d(x.double(), weight.double(), bias.double(), padding=1) + r.double())
    kernel = WinogradBf16Tactic().prepare(_bf16_io_view(x_bf16, out_bf16, res_bf16, c, cout, hw, weight, bias))
    got = kernel([x, None, None, r])[0]
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    assert got.is_contiguous(memory_format=torch.channels_last)
    err = ((got.double() - want).abs() / want.abs().clamp(min=1.0)).max().item()
    assert err < (2 ** -8 if out_bf16 else 1e-4), err   # FP32 Winograd F(4,3): ~4e-5; bf16: rounded once more
    into_residual = kernel.into_input[1]([x, None, None, r.clone()])[0]   # the residual's buffer, read first
    assert torch.equal(into_residual, got)


def test_bf16_storage_winograd_is_offered_only_on_bf16_cpus(monkeypatch):
    view = _bf16_io_view(True, True, False, 16, 16, 10, torch.randn(16, 16, 3, 3), torch.randn(16))
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    assert not WinogradBf16Tactic().supports(view)
    assert not WinogradConvTactic(4).supports(view)   # the FP32 tactic reads FP32 only


@pytest.mark.parametrize("kind", ["f2", "f4", "f4-bf16"])
def test_writes_into_a_channel_slice_what_it_returns(kind):
    """kiln.runtime.elision's write_into: output pixels a wider tensor's channels apart, the same bits the kernel
    returns, the channels around the slice untouched; a fused residual or a post-pass activation offers none."""
    if not native.available() or (kind == "f4-bf16" and not hardware.has_any(hardware.BF16_ISA)):
        pytest.skip("needs a C compiler (and a CPU computing BF16 for the bf16-storage variant)")
    g = torch.Generator().manual_seed(7)
    c, cout, hw = 24, 40, 13                        # partial tiles, a partial column panel
    weight, bias = torch.randn(cout, c, 3, 3, generator=g) * 0.2, torch.randn(cout, generator=g)
    if kind == "f4-bf16":
        view = _bf16_io_view(True, True, False, c, cout, hw, weight, bias)
        view = dataclasses.replace(view, input_shapes=view.input_shapes[:3], input_dtypes=view.input_dtypes[:3])
        tactic = WinogradBf16Tactic()
    else:
        view = conv_view(c, cout, hw, hw, activation="Swish")
        view = dataclasses.replace(view, input_shapes=((2, c, hw, hw), *view.input_shapes[1:]),
                                   const_inputs={1: weight, 2: bias})
        tactic = WinogradConvTactic(int(kind[1]))
    kernel = tactic.prepare(view)
    x = torch.randn(2, c, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    xs = [x.bfloat16() if kind == "f4-bf16" else x, None, None]
    want = kernel(xs)[0]
    wide = torch.full((2, 16 + cout + 8, hw, hw), 7.0, dtype=want.dtype).contiguous(memory_format=torch.channels_last)
    kernel.write_into(xs, wide.narrow(1, 16, cout))
    assert torch.equal(wide.narrow(1, 16, cout), want)
    assert bool((wide.narrow(1, 0, 16) == 7).all()) and bool((wide.narrow(1, 16 + cout, 8) == 7).all())
    row_major = torch.zeros(2, 2 * cout, hw, hw, dtype=want.dtype).narrow(1, 0, cout)   # not channel-major: copied
    kernel.write_into(xs, row_major)
    assert torch.equal(row_major, want)
    assert getattr(WinogradConvTactic(4).prepare(conv_view(c, cout, hw, hw, residual=True)), "write_into", None) \
        is None
    assert getattr(WinogradConvTactic(4).prepare(conv_view(c, cout, hw, hw, activation="Sigmoid")), "write_into",
                   None) is None
