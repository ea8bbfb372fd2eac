"""Shuffles as one copy in C (kiln.tactics.shuffle_c): the composition of reshape and transpose steps into one
permutation, the kernel against torch's step-by-step reference on random step chains of every element size, reading
a channel-major input as it lies, returning a channel-major view where the output is one, and in an engine against
onnxruntime (MobileViT's patch unfold; ConvNeXt's Transposes around a LayerNorm, with no Reformat left)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.ops.fused import apply_steps
from kiln.tactics.base import HWC, LINEAR, LayerView
from kiln.tactics.shuffle_c import Permutation, PermuteCopyBf16Tactic, PermuteCopyTactic, compose
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort

UNFOLD = [{"reshape": [2304, 2, 16, 2]}, {"transpose": [0, 2, 1, 3]}, {"reshape": [1, 144, 256, 4]},
          {"transpose": [0, 3, 2, 1]}, {"reshape": [4, 256, 144]}]   # MobileViT: [1, 144, 32, 32] into 2x2 patches


def view(shape, steps, dtype="float32", out=None):
    return LayerView("Shuffle", "kiln", {"steps": steps}, (tuple(shape),), (dtype,), {}, (out or dtype,))


def test_steps_compose_into_one_permutation_of_the_inputs_factors():
    # channels, row blocks, rows in a patch, column blocks, columns in a patch -> (patch row, patch column, row
    # block, column block, channel)
    assert compose((1, 144, 32, 32), UNFOLD) == Permutation((144, 16, 2, 16, 2), (2, 4, 1, 3, 0), (4, 256, 144))
    assert compose((1, 128, 256), [{"reshape": [1, 128, 8, 32]}, {"transpose": [0, 2, 1, 3]}]) == \
        Permutation((128, 8, 32), (1, 0, 2), (1, 8, 128, 32))
    assert compose((2, 3, 4), [{"reshape": [6, 4]}, {"reshape": [2, 12]}]) == Permutation((24,), (), (2, 12))
    # a reshape whose axis boundary falls inside a transposed factor (4 * 3 into 6 * 2), and a slice: not composed
    assert compose((2, 3, 4), [{"transpose": [0, 2, 1]}, {"reshape": [2, 6, 2]}]) is None
    assert compose((2, 3, 4), [{"slice": [1, 0, 2]}]) is None
    assert compose((1, 3, 1, 4), [{"transpose": [2, 1, 0, 3]}]).perm == ()   # only size-1 axes move: a view


def _random_steps(rng: random.Random, shape: list[int]) -> list[dict]:
    steps, current = [], list(shape)
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.5 and len(current) > 1:
            perm = list(range(len(current)))
            rng.shuffle(perm)
            steps.append({"transpose": perm})
            current = [current[p] for p in perm]
        else:
            factors = [f for n in current for f in _prime_factors(n)]
            rng.shuffle(factors)
            dims = [1] * rng.randint(1, max(1, min(5, len(factors))))
            for f in factors:
                dims[rng.randrange(len(dims))] *= f
            steps.append({"reshape": dims})
            current = dims
    return steps


def _prime_factors(n: int) -> list[int]:
    out, d = [], 2
    while n > 1:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
def test_random_step_chains_equal_the_reference_bit_for_bit(dtype):
    """Element sizes 4, 2, 1 and 8; row-major and channel-major inputs through one prepared kernel (plans cached per
    shape and layout); what composes runs in C, exactly."""
    rng, ran, copies = random.Random(11), 0, 0
    for _ in range(150):
        shape = [rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 20]) for _ in range(rng.randint(1, 5))]
        steps = _random_steps(rng, shape)
        name = str(dtype).removeprefix("torch.")
        tactic, layer = PermuteCopyTactic(), view(shape, steps, name)
        if not tactic.supports(layer):
            continue
        x = (torch.randn(shape) * 60).to(dtype)
        inputs = [x] + ([x.contiguous(memory_format=torch.channels_last)] if len(shape) == 4 else [])
        kernel = tactic.prepare(layer)
        for given in inputs:
            got = kernel([given])[0]
            assert torch.equal(got, apply_steps(x, steps)), (shape, steps)
            copies += got.data_ptr() != given.data_ptr()
        ran += 1
    assert ran > 60 and copies >= 15   # most chains compose; a fair share copies (the rest are views)


def test_large_tiles_and_runs_are_shared_among_threads_exactly():
    for shape, steps in [((1, 144, 32, 32), UNFOLD), ((1, 96, 56, 56), [{"transpose": [0, 2, 3, 1]}]),
                         ((1, 197, 768), [{"reshape": [1, 197, 12, 64]}, {"transpose": [0, 2, 1, 3]}])]:
        for dtype in (torch.float32, torch.uint8):
            x = (torch.rand(shape) * 255).to(dtype)
            got = PermuteCopyTactic().prepare(view(shape, steps, str(dtype).removeprefix("torch.")))([x])[0]
            assert got.is_contiguous() and torch.equal(got, apply_steps(x, steps).contiguous())


def test_a_channel_major_result_is_a_view_of_the_input():
    """NHWC -> NCHW ([0, 3, 1, 2]) of a row-major input is the input's bytes in channel-major order: output_format
    says HWC and the kernel copies nothing; NCHW -> NHWC of a channel-major input is a row-major view."""
    back, forth = [{"transpose": [0, 3, 1, 2]}], [{"transpose": [0, 2, 3, 1]}]
    tactic = PermuteCopyTactic()
    assert tactic.output_format(view((1, 5, 6, 8), back), [LINEAR]) == HWC
    assert tactic.output_format(view((1, 8, 5, 6), forth), [HWC]) == LINEAR
    assert tactic.output_format(view((1, 8, 5, 6), forth), [LINEAR]) == LINEAR
    x = torch.randn(1, 5, 6, 8)
    y = tactic.prepare(view((1, 5, 6, 8), back))([x])[0]
    assert y.data_ptr() == x.data_ptr() and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, x.permute(0, 3, 1, 2))
    nhwc = torch.randn(1, 8, 5, 6).contiguous(memory_format=torch.channels_last)
    z = tactic.prepare(view((1, 8, 5, 6), forth))([nhwc])[0]
    assert z.data_ptr() == nhwc.data_ptr() and z.is_contiguous() and torch.equal(z, nhwc.permute(0, 2, 3, 1))


def test_short_scattered_output_rows_stay_with_torch():
    """MobileViT's fold back (2-float output rows scattered across the channels) is slower tiled: not taken."""
    fold = [{"reshape": [1, 4, 256, 144]}, {"transpose": [0, 3, 2, 1]}, {"reshape": [2304, 16, 2, 2]},
            {"transpose": [0, 2, 1, 3]}, {"reshape": [1, 144, 32, 32]}]
    assert not PermuteCopyTactic().supports(view((4, 256, 144), fold))
    assert PermuteCopyTactic().supports(view((1, 144, 32, 32), UNFOLD))


@pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA), reason="no native BF16: BF16 tactics are not offered")
def test_bf16_storage_converts_to_the_output_type_first():
    x = torch.randn(2, 12, 4)
    layer = view((2, 12, 4), [{"transpose": [0, 2, 1]}], "float32", "bfloat16")
    assert PermuteCopyBf16Tactic().supports(layer) and not PermuteCopyTactic().supports(layer)
    y = PermuteCopyBf16Tactic().prepare(layer)([x])[0]
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.bfloat16().transpose(1, 2))


def convnext_block() -> bytes:
    """Conv -> Transpose to NHWC -> LayerNorm over channels -> MatMul -> Transpose back -> Conv (ConvNeXt's)."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="dwconv", pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["c1"], ["t1"], name="to_nhwc", perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["t1", "g", "b"], ["n"], name="norm", axis=-1),
             helper.make_node("MatMul", ["n", "wp"], ["p"], name="pwconv"),
             helper.make_node("Transpose", ["p"], ["t2"], name="to_nchw", perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["t2", "w2"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    inits = [init("w1", rand((16, 16, 3, 3), seed=1) * 0.2), init("g", rand((16,), seed=2)),
             init("b", rand((16,), seed=3)), init("wp", rand((16, 16), seed=4) * 0.3),
             init("w2", rand((8, 16, 3, 3), seed=5) * 0.2)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def test_convnext_transposes_between_channel_major_convolutions_are_views():
    model = convnext_block()
    engine = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime")
    layers = {l.name: l for l in engine.plan.layers}
    order = [l.name for l in engine.plan.layers if l.op_type != "Reformat" or "Input Tensor" not in l.name]
    assert order[:6] == ["dwconv", "to_nhwc", "norm", "pwconv", "to_nchw", "conv"]   # no Reformat between them
    assert {layers[n].tactic_name for n in ("to_nhwc", "to_nchw")} == {"kiln.permute_copy"}
    x = rand((1, 16, 12, 12), seed=6)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_mobilevit_unfold_runs_in_c_and_matches_onnxruntime():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r1"], name="r1"),
             helper.make_node("Transpose", ["r1"], ["t1"], name="t1", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["t1", "s2"], ["r2"], name="r2"),
             helper.make_node("Transpose", ["r2"], ["t2"], name="t2", perm=[0, 3, 2, 1]),
             helper.make_node("Reshape", ["t2", "s3"], ["y"], name="r3")]
    inits = [init(n, np.array(v, np.int64)) for n, v in (("s1", [48, 2, 4, 2]), ("s2", [1, 12, 16, 4]),
                                                          ("s3", [4, 16, 12]))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    engine = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime")
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("Shuffle", "kiln.permute_copy")]
    x = rand((1, 12, 8, 8), seed=7)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_sixteen_bit_integers_and_nan_payloads_move_bit_for_bit():
    """The tile edges move 16-bit elements as they are: int16 values whose pattern is a bf16 NaN, float16 NaNs."""
    ints = torch.arange(-200, 40, dtype=torch.int16).reshape(1, 12, 20)
    halves = torch.tensor([float("nan"), 1.5, -0.0, float("inf")] * 60, dtype=torch.float16).reshape(1, 12, 20)
    halves.view(torch.int16)[0, 0, 0] = 0x7D01   # a signalling NaN's payload
    for x, name in ((ints, "int16"), (halves, "float16")):
        y = PermuteCopyTactic().prepare(view((1, 12, 20), [{"transpose": [0, 2, 1]}], name))([x])[0]
        assert torch.equal(y.view(torch.int16), x.transpose(1, 2).contiguous().view(torch.int16))


def test_a_dynamic_shuffle_writes_row_major():
    """Whether the output is a channel-major view can turn on a dynamic axis being 1: such layers say LINEAR and
    copy row-major at every size."""
    steps = [{"transpose": [1, 2, 0]}, {"reshape": [-1, 8, 4, 4]}]
    layer = LayerView("Shuffle", "kiln", {"steps": steps}, ((16, 1, 8),), ("float32",), {}, ("float32",), 17, ((1,),))
    assert PermuteCopyTactic().output_format(layer, [LINEAR]) == LINEAR
    kernel = PermuteCopyTactic().prepare(layer)
    for n in (1, 2):
        x = torch.randn(16, n, 8)
        y = kernel([x])[0]
        assert y.is_contiguous() and torch.equal(y, apply_steps(x, steps))
