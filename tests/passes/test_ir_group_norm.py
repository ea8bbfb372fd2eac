"""GroupNormFusion and NormActFusion on IR graphs: torch's GroupNorm export (Reshape to [N, G, -1],
InstanceNormalization, Reshape back, Mul by the weight, Add the bias; the Reshapes are Shuffles by then) becomes one
GroupNormalization with per-channel scale and bias; a following SiLU or ReLU is absorbed; near misses say why.
The end-to-end checks against onnxruntime are in tests/passes/test_group_norm.py."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.conv import fuse_norm_activation
from kiln.passes.normalization import fuse_group_norm
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

EPS = 2.0 ** -16
SHAPE = (1, 4, 2, 2)


def torch_group_norm(b: IRBuilder, x, groups=2, in_scale=(1.0, 1.0), in_bias=(0.0, 0.0), gamma=None, beta=None,
                     dyn_dims=()):
    """x -> s1 (reshape [N, G, -1]) -> n (InstanceNorm) -> s2 (reshape back) [-> m (Mul gamma)] [-> a (Add beta)]."""
    n, c = x.shape[:2]
    grouped = (n, groups, int(np.prod(x.shape[1:])) // groups)
    s1 = b.node("Shuffle", [x], "s1", grouped, domain="kiln", dyn_dims=dyn_dims, steps=[{"reshape": [0, groups, -1]}])
    inorm = b.node("InstanceNormalization", [s1, b.const("is", in_scale), b.const("ib", in_bias)], "n", grouped,
                   dyn_dims=dyn_dims, epsilon=EPS)
    y = b.node("Shuffle", [inorm], "s2", x.shape, domain="kiln", dyn_dims=x.dyn_dims, steps=[{"reshape": list(x.shape)}])
    if gamma is not None:
        y = b.node("Mul", [y, b.const("gamma", np.asarray(gamma, np.float32).reshape(c, 1, 1))], "m", x.shape)
    if beta is not None:
        y = b.node("Add", [b.const("beta", np.asarray(beta, np.float32).reshape(c, 1, 1)), y], "a", x.shape)
    return y


def test_torchs_group_norm_with_weight_and_bias_is_one_layer():
    b = IRBuilder()
    x = b.input("x", SHAPE)
    g = b.graph(b.node("Relu", [torch_group_norm(b, x, gamma=[1, 2, 3, 4], beta=[0.5, 0, 0, -0.5])], "r", SHAPE))

    run = run_pass(g, "GroupNormFusion", fuse_group_norm)

    assert str(g) == expected("""
        graph g(%x: float32[1x4x2x2]):
          %a: float32[1x4x2x2] = GroupNormalization(%x, const %s1 + n + s2 + m + a.scale, const %s1 + n + s2 + m + a.bias) epsilon=1.52587890625e-05 num_groups=2  # s1 + n + s2 + m + a
          %r: float32[1x4x2x2] = Relu(%a)  # r
          return %r
        """)
    norm = g.nodes[0]
    assert norm.inputs[1].const.tolist() == [1, 2, 3, 4] and norm.inputs[2].const.tolist() == [0.5, 0, 0, -0.5]
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "GroupNormFusion: Fusing s1 with a" in run.lines


def test_the_instance_norms_per_group_affine_folds_into_the_per_channel_one():
    b = IRBuilder()
    x = b.input("x", SHAPE)
    g = b.graph(torch_group_norm(b, x, in_scale=(2.0, 3.0), in_bias=(1.0, -1.0), gamma=[1, 2, 3, 4]))

    run_pass(g, "GroupNormFusion", fuse_group_norm)

    (norm,) = g.nodes
    assert norm.name == "s1 + n + s2 + m"   # no Add: the bias is the InstanceNorm's, times gamma
    assert norm.inputs[1].const.tolist() == [2, 4, 9, 12] and norm.inputs[2].const.tolist() == [1, 2, -3, -4]


def test_a_dynamic_batch_still_fuses():
    b = IRBuilder()
    x = b.input("x", SHAPE, dyn_dims=(0,))
    g = b.graph(torch_group_norm(b, x, beta=[0, 0, 0, 1], dyn_dims=(0,)))

    run_pass(g, "GroupNormFusion", fuse_group_norm)

    assert [n.op_type for n in g.nodes] == ["GroupNormalization"] and g.nodes[0].attrs["num_groups"] == 2


def test_near_misses_say_why():
    b = IRBuilder()
    x = b.input("x", SHAPE)
    y = torch_group_norm(b, x, gamma=[1, 1, 1, 1])
    g = b.graph(y)
    g.outputs.append(g.values["s1"])   # the grouped view is also a network output
    run = run_pass_unchanged(g, "GroupNormFusion", fuse_group_norm)
    assert run.not_fusing == ["GroupNormFusion: Not fusing s1 with n: s1's output is also used outside the pattern"]


def test_a_dynamic_spatial_axis_is_a_near_miss():
    b = IRBuilder()
    x = b.input("x", SHAPE, dyn_dims=(3,))
    g = b.graph(torch_group_norm(b, x, dyn_dims=(2,)))

    run = run_pass(g, "GroupNormFusion", fuse_group_norm)

    assert run.not_fusing == ["GroupNormFusion: Not fusing s1 with n: a dynamic axis other than the batch"]


def test_a_batch_that_differs_at_the_probe_point_is_a_near_miss():
    """The grouped view's batch equals the input's at the opt point but not at the probe point (a reshape that
    folds another dynamic axis into it): not one group norm."""
    b = IRBuilder()
    x = b.input("x", SHAPE, dyn_dims=(0,))
    g = b.graph(torch_group_norm(b, x, dyn_dims=(0,)))
    g.values["s1"].probe_shape = (6, 2, 8)

    run = run_pass_unchanged(g, "GroupNormFusion", fuse_group_norm)

    assert run.not_fusing == ["GroupNormFusion: Not fusing s1 with n: the grouped batch may differ from the input's at "
                              "other input shapes (1(3)x4x2x2, 1(6)x2x8, 1(3)x4x2x2; probe sizes in brackets)"]


def test_per_element_mul_stays_outside():
    b = IRBuilder()
    x = b.input("x", SHAPE)
    y = torch_group_norm(b, x)
    g = b.graph(b.node("Mul", [y, b.const("w", np.ones((4, 2, 2)))], "m", SHAPE))

    run_pass(g, "GroupNormFusion", fuse_group_norm)

    assert [(n.name, n.op_type) for n in g.nodes] == [("s1 + n + s2", "GroupNormalization"), ("m", "Mul")]


def group_norm_then(b: IRBuilder, act: str, **attrs):
    x = b.input("x", SHAPE)
    norm = b.node("GroupNormalization", [x, b.const("s", np.ones(4)), b.const("b", np.zeros(4))], "gn", SHAPE,
                  num_groups=2, epsilon=EPS)
    return b.graph(b.node(act, [norm], "act", SHAPE, **attrs))


@pytest.mark.parametrize("act, attrs", [("Swish", {"alpha": 1.0}), ("Relu", {})])
def test_silu_and_relu_are_absorbed(act, attrs):
    g = group_norm_then(IRBuilder(), act, **attrs)

    run = run_pass(g, "NormActFusion", fuse_norm_activation)

    (norm,) = g.nodes
    assert (norm.name, norm.op_type, norm.attrs["activation"]) == ("gn + act", "GroupNormalization",
                                                                   {"op": act, "attrs": attrs})
    assert run.stat.matches == 1


@pytest.mark.parametrize("act, attrs", [("Gelu", {}), ("Swish", {"alpha": 1.702})])
def test_activations_the_kernels_lack_stay_with_a_reason(act, attrs):
    g = group_norm_then(IRBuilder(), act, **attrs)

    run = run_pass(g, "NormActFusion", fuse_norm_activation)

    assert [n.name for n in g.nodes] == ["gn", "act"]
    assert run.not_fusing == ["NormActFusion: Not fusing gn with act: kiln's GroupNormalization kernels apply Relu "
                              "and Swish only"]
