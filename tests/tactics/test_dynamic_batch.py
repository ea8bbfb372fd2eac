"""A dynamic batch (axis 0 varying with the input shapes, spatial axes fixed) on kiln's C convolution and pooling
kernels: each is prepared at the profile's opt batch and reads the batch per call, so one kernel gives every batch
size what the formula gives (the common export, `dynamic_axes={"input": {0: "batch"}}`, used to fall back to oneDNN
or torch). Dynamic spatial axes stay declined (tests in each tactic's file)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.conv1x1 import Conv1x1GemmTactic
from kiln.tactics.conv_direct import DirectConvTactic
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, Conv1x1GemmBf16Tactic, DirectConvBf16Tactic
from kiln.tactics.pool_c import NhwcPoolTactic
from kiln.tactics.qgemm_c import VNNI_ISA, QConvDirectTactic, QConvGemmTactic
from kiln.tactics.winograd import WinogradConvTactic
from tests.tactics.test_conv1x1 import channels_last, conv_view
from tests.tactics.test_conv_direct import reference
from tests.tactics.test_qgemm_c import assert_requantized_equal, conv_formula, qconv_view, quant, rand_q

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")
BATCHES = (1, 3, 5)   # prepared at 2: smaller, larger, and a batch that splits work units unevenly
bf16_only = pytest.mark.skipif(not hardware.has_any(BF16_DOT_ISA), reason="no AVX512-BF16 on this CPU")


def batch(view: LayerView, n: int) -> list:
    xs = [channels_last(n, *view.input_shapes[0][1:], seed=n), None, None]
    if len(view.input_shapes) > 3:
        xs.append(channels_last(n, *view.input_shapes[3][1:], seed=n + 10))
    return xs


@pytest.mark.parametrize("tactic, view, rtol", [
    (Conv1x1GemmTactic(), conv_view(48, 70, 9, 7, n=2, residual=True, dynamic=(0,)), 1e-5),
    (DirectConvTactic(), conv_view(16, 40, 11, 9, stride=2, n=2, kernel=3, pads=(1, 1, 1, 1), dynamic=(0,)), 1e-5),
    (WinogradConvTactic(4), conv_view(16, 24, 13, 11, n=2, residual=True, kernel=3, pads=(1, 1, 1, 1),
                                      dynamic=(0,)), 1e-4),
    pytest.param(Conv1x1GemmBf16Tactic(), conv_view(48, 70, 9, 7, n=2, residual=True, dynamic=(0,)), None,
                 marks=bf16_only),
    pytest.param(DirectConvBf16Tactic(), conv_view(16, 40, 11, 9, n=2, kernel=3, pads=(1, 1, 1, 1), dynamic=(0,)),
                 None, marks=bf16_only),
], ids=["1x1", "direct", "winograd", "1x1_bf16", "direct_bf16"])
def test_convolutions_read_the_batch_per_call(tactic, view, rtol):
    """`rtol` None: a BF16 kernel, against the formula on bf16-rounded input and weights (FP32 sums)."""
    assert tactic.supports(view)
    kernel = tactic.prepare(view)
    bf16 = rtol is None
    rounded = {**view.const_inputs, 1: view.const_inputs[1].bfloat16().float()}
    formula = dataclasses.replace(view, const_inputs=rounded) if bf16 else view
    for n in BATCHES:
        xs = batch(view, n)
        got = kernel(xs)[0]
        want = reference(formula, [xs[0].bfloat16().float()] + xs[1:] if bf16 else xs).float()
        assert got.shape == want.shape and got.shape[0] == n
        torch.testing.assert_close(got, want, rtol=rtol or 1e-4, atol=rtol or 1e-4)


@pytest.mark.parametrize("op, attrs", [("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
                                       ("GlobalAveragePool", {})])
def test_pools_read_the_batch_per_call(op, attrs):
    view = LayerView(op, "", attrs, ((2, 24, 9, 9),), ("float32",), {}, ("float32",), input_dynamic=((0,),))
    assert NhwcPoolTactic().supports(view)
    kernel = NhwcPoolTactic().prepare(view)
    for n in BATCHES:
        x = channels_last(n, 24, 9, 9, seed=n)
        want = (torch.nn.functional.max_pool2d(x, 3, 2, 1) if op == "MaxPool" else x.mean((2, 3), keepdim=True))
        torch.testing.assert_close(kernel([x])[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not hardware.has_any(VNNI_ISA), reason="no AVX512-VNNI on this CPU")
@pytest.mark.parametrize("tactic, kernel_size, pads", [(QConvGemmTactic(), 1, (0, 0, 0, 0)),
                                                       (QConvDirectTactic(), 3, (1, 1, 1, 1))], ids=["1x1", "3x3"])
def test_int8_convolutions_read_the_batch_per_call(tactic, kernel_size, pads):
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (40, 16, kernel_size, kernel_size), generator=g, dtype=torch.int8)
    view = qconv_view((2, 16, 7, 9), w, quant(40), pads, act={"op": "Relu", "attrs": {}})
    view = dataclasses.replace(view, input_dynamic=((0,), (), ()))
    assert tactic.supports(view)
    kernel = tactic.prepare(view)
    for n in BATCHES:
        x = rand_q((n, 16, 7, 9), "uint8", g).contiguous(memory_format=torch.channels_last)
        got = kernel([x, None, None])[0]
        assert got.shape[0] == n
        assert_requantized_equal(got, conv_formula(view, x))
