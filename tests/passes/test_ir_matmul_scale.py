"""MatMulScaleFusion on IR graphs: a BatchNormalization over a product's columns folds into its weights and bias,
through the reshapes that keep the columns last; and the reasons when it does not."""
from __future__ import annotations

import numpy as np

from kiln.passes.matmul_scale import fold_batchnorm_into_matmul
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged


def bn_params(b: IRBuilder):
    """k = scale / sqrt(var + 1) = [2, 1, 0.5]; shift = B - mean * k = [-1.5, 1, 0]."""
    return [b.const("scale", [4.0, 3.0, 1.0]), b.const("B", [0.5, 3.0, 1.0]), b.const("mean", [1.0, 2.0, 2.0]),
            b.const("var", [3.0, 8.0, 3.0])]


W = np.array([[1.0, 2.0, 4.0], [-1.0, 0.5, 2.0]], np.float32)   # [K=2, N=3]


def linear_flatten_bn(b: IRBuilder, flatten_to=(4, 3), back=True):
    """torch's Linear(bias=False) -> Flatten(0, 1) -> BatchNorm1d -> Reshape back (LeViT's MLPLayerWithBN)."""
    x = b.input("x", (1, 4, 2))
    m = b.node("MatMul", [x, b.const("w", W)], "m", (1, 4, 3), name="linear")
    f = b.shuffle(m, "f", flatten_to, [{"reshape": list(flatten_to)}])
    y = b.node("BatchNormalization", [f] + bn_params(b), "bn_out", flatten_to, name="bn", epsilon=1.0)
    return b.shuffle(y, "y", (1, 4, 3), [{"reshape": [1, 4, 3]}]) if back else y


def test_batchnorm_after_a_flatten_folds_into_the_products_columns():
    b = IRBuilder()
    g = b.graph(linear_flatten_bn(b))

    run = run_pass(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert str(g) == expected("""
        graph g(%x: float32[1x4x2]):
          %m: float32[1x4x3] = MatMul(%x, const %linear.weight_scaled, const %linear.bias_scaled)  # linear + bn
          %bn_out: float32[4x3] = kiln.Shuffle(%m) steps=[{'reshape': [4, 3]}]  # f
          %y: float32[1x4x3] = kiln.Shuffle(%bn_out) steps=[{'reshape': [1, 4, 3]}]  # y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "MatMulScaleFusion: Fusing linear with bn" in run.lines
    np.testing.assert_array_equal(g.values["linear.weight_scaled"].const, W * np.array([2.0, 1.0, 0.5], np.float32))
    np.testing.assert_array_equal(g.values["linear.bias_scaled"].const, np.array([-1.5, 1.0, 0.0], np.float32))
    assert g.nodes[0].origin == ("linear", "bn")


def test_a_batchnorm_that_is_the_network_output_keeps_its_name():
    b = IRBuilder()
    g = b.graph(linear_flatten_bn(b, back=False))

    run_pass(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert [v.name for v in g.outputs] == ["bn_out"]
    assert [n.op_type for n in g.nodes] == ["MatMul", "Shuffle"]


def test_gemm_with_transposed_weights_and_a_scaled_bias_takes_the_batchnorm():
    """Gemm(x, B^T, C, beta=0.5) -> BN: rows of B scale by k, the bias becomes (beta*C - mean)*k + B, beta 1."""
    b = IRBuilder()
    x = b.input("x", (4, 2))
    gm = b.node("Gemm", [x, b.const("w", W.T), b.const("c", [2.0, -2.0, 4.0])], "gm", (4, 3), name="fc", transB=1,
                beta=0.5)
    g = b.graph(b.node("BatchNormalization", [gm] + bn_params(b), "y", (4, 3), name="features", epsilon=1.0))

    run_pass(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert str(g) == expected("""
        graph g(%x: float32[4x2]):
          %y: float32[4x3] = Gemm(%x, const %fc.weight_scaled, const %fc.bias_scaled) beta=1.0 transB=1  # fc + features
          return %y
        """)
    np.testing.assert_array_equal(g.values["fc.weight_scaled"].const, W.T * np.array([[2.0], [1.0], [0.5]]))
    # beta * C = [1, -1, 2]; * k = [2, -1, 1]; + shift [-1.5, 1, 0]
    np.testing.assert_array_equal(g.values["fc.bias_scaled"].const, np.array([0.5, 0.0, 1.0], np.float32))


def test_a_constant_bias_add_between_joins_the_folded_bias():
    b = IRBuilder()
    x = b.input("x", (4, 2))
    m = b.node("MatMul", [x, b.const("w", W)], "m", (4, 3), name="linear")
    a = b.node("Add", [b.const("bias", [[1.0, 1.0, 2.0]]), m], "a", (4, 3), name="add")
    g = b.graph(b.node("BatchNormalization", [a] + bn_params(b), "y", (4, 3), name="bn", epsilon=1.0))

    run_pass(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert [(n.name, n.op_type, n.origin) for n in g.nodes] == [("linear + add + bn", "MatMul",
                                                                ("linear", "add", "bn"))]
    np.testing.assert_array_equal(g.nodes[0].inputs[2].const, np.array([0.5, 2.0, 1.0], np.float32))


def test_a_rank_3_batchnorm_normalizes_rows_and_stays():
    b = IRBuilder()
    x = b.input("x", (1, 3, 2))
    m = b.node("MatMul", [x, b.const("w", W[:, :3])], "m", (1, 3, 3), name="linear")
    g = b.graph(b.node("BatchNormalization", [m] + bn_params(b), "y", (1, 3, 3), name="bn", epsilon=1.0))

    run = run_pass_unchanged(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert run.not_fusing == ["MatMulScaleFusion: Not fusing linear with bn: bn normalizes axis 1 of a "
                              "rank-3 tensor, not the product's columns"]


def test_a_reshape_that_splits_the_columns_blocks_the_fold():
    b = IRBuilder()
    x = b.input("x", (1, 2, 2))
    m = b.node("MatMul", [x, b.const("w", np.ones((2, 6)))], "m", (1, 2, 6), name="linear")
    f = b.shuffle(m, "f", (6, 2), [{"reshape": [6, 2]}])
    params = [b.const(n, v) for n, v in (("s", [1.0, 1.0]), ("B", [0.0, 0.0]), ("mu", [0.0, 0.0]), ("v", [1.0, 1.0]))]
    g = b.graph(b.node("BatchNormalization", [f] + params, "y", (6, 2), name="bn"))

    run = run_pass_unchanged(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert run.not_fusing == ["MatMulScaleFusion: Not fusing linear with bn: f does not keep the product's 6 "
                              "columns as its last axis"]


def test_a_product_read_elsewhere_or_with_computed_weights_keeps_its_batchnorm():
    b = IRBuilder()
    x = b.input("x", (4, 2))
    m = b.node("MatMul", [x, b.const("w", W)], "m", (4, 3), name="linear")
    y = b.node("BatchNormalization", [m] + bn_params(b), "y", (4, 3), name="bn", epsilon=1.0)
    w2 = b.input("w2", (2, 3))
    m2 = b.node("MatMul", [x, w2], "m2", (4, 3), name="linear2")
    params2 = [b.const(f"p_{n}", v.const) for n, v in zip("sBmv", bn_params(IRBuilder()))]
    y2 = b.node("BatchNormalization", [m2] + params2, "y2", (4, 3), name="bn2", epsilon=1.0)
    g = b.graph(y, m, y2)

    run = run_pass_unchanged(g, "MatMulScaleFusion", fold_batchnorm_into_matmul)

    assert run.not_fusing == [
        "MatMulScaleFusion: Not fusing linear with bn: linear's output 'm' is a network output",
        "MatMulScaleFusion: Not fusing linear2 with bn2: linear2's weights are not a constant float matrix"]


def _refused(build) -> list[str]:
    b = IRBuilder()
    g = b.graph(build(b))
    return run_pass_unchanged(g, "MatMulScaleFusion", fold_batchnorm_into_matmul).not_fusing


def test_refusals_name_what_blocks_the_fold():
    def bn(b, x, shape, **attrs):
        return b.node("BatchNormalization", [x] + bn_params(b), "y", shape, name="bn", epsilon=1.0, **attrs)

    def training(b):
        m = b.node("MatMul", [b.input("x", (4, 2)), b.const("w", W)], "m", (4, 3), name="linear")
        return bn(b, m, (4, 3), training_mode=1)

    def per_row_bias(b):
        m = b.node("MatMul", [b.input("x", (3, 2)), b.const("w", W)], "m", (3, 3), name="linear")
        return bn(b, b.node("Add", [m, b.const("c", [[1.0], [2.0], [3.0]])], "a", (3, 3), name="add"), (3, 3))

    def broadcast_up(b):   # [3] + [1, 3] -> [1, 3]: folding would leave the product's [3]
        m = b.node("MatMul", [b.input("x", (2,)), b.const("w", W)], "m", (3,), name="linear")
        return bn(b, b.node("Add", [m, b.const("c", [[1.0, 2.0, 3.0]])], "a", (1, 3), name="add"), (1, 3))

    def computed_bias(b):
        gm = b.node("Gemm", [b.input("x", (4, 2)), b.const("w", W), b.input("c", (3,))], "gm", (4, 3), name="linear")
        return bn(b, gm, (4, 3))

    def with_activation(b):
        m = b.node("MatMul", [b.input("x", (4, 2)), b.const("w", W)], "m", (4, 3), name="linear",
                   activation={"op": "Relu", "attrs": {}})
        return bn(b, m, (4, 3))

    def dynamic_columns(b):
        m = b.node("MatMul", [b.input("x", (1, 4, 2)), b.const("w", W)], "m", (1, 4, 3), name="linear")
        f = b.shuffle(m, "f", (4, 3), [{"reshape": [4, -1]}], dyn_dims=(1,))
        return bn(b, f, (4, 3))

    assert _refused(training) == ["MatMulScaleFusion: Not fusing linear with bn: bn runs in training mode"]
    for case in (per_row_bias, broadcast_up):
        assert _refused(case) == ["MatMulScaleFusion: Not fusing linear with bn: add adds a constant that is not "
                                  "one value per column"]
    assert _refused(computed_bias) == ["MatMulScaleFusion: Not fusing linear with bn: linear's bias is computed at "
                                       "run time"]
    assert _refused(with_activation) == ["MatMulScaleFusion: Not fusing linear with bn: linear already has a fused "
                                         "activation or residual"]
    assert _refused(dynamic_columns) == ["MatMulScaleFusion: Not fusing linear with bn: f does not keep the "
                                         "product's 3 columns as its last axis"]
