"""Small models for the accuracy and calibration tests, built with onnx.helper."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import init, make_model, rand


def conv_net(relu2: bool = True, pool: str = "GlobalAveragePool") -> onnx.ModelProto:
    """conv1+relu -> conv2(+relu) -> global pool -> flatten -> MatMul -> Gemm(transB). `pool="Einsum"`: the pool
    as a sum over the map, Einsum "nchw->nc" (node "sumpool": kiln has no BF16 kernel for Einsum)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu" if relu2 else "Identity", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap") if pool == "GlobalAveragePool" else
             helper.make_node("Einsum", ["r2"], ["g"], name="sumpool", equation="nchw->nc"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("MatMul", ["f", "fc_w"], ["m"], name="fc"),
             helper.make_node("Gemm", ["m", "g_w", "g_b"], ["y"], name="head", transB=1)]
    inits = [init("w1", rand((8, 3, 3, 3), 1) * 0.3), init("b1", rand((8,), 2) * 0.1),
             init("w2", rand((16, 8, 3, 3), 3) * 0.2), init("b2", rand((16,), 4) * 0.1),
             init("fc_w", rand((16, 10), 5)), init("g_w", rand((6, 10), 6)), init("g_b", rand((6,), 7))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits, name="convnet")


def transformer_net(seq: int = 8, dim: int = 16, pooled: bool = False) -> onnx.ModelProto:
    """One encoder block: single-head attention, residual, LayerNorm, GELU (Erf) MLP, residual; `pooled`: then a
    sum over the sequence (Einsum "bsd->bd": no BF16 kernel)."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "wq"], ["q"], name="q_proj"), h("MatMul", ["x", "wk"], ["k"], name="k_proj"),
             h("MatMul", ["x", "wv"], ["v"], name="v_proj"),
             h("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
             h("MatMul", ["q", "kt"], ["s"], name="scores"), h("Mul", ["s", "scale"], ["ss"], name="scale_mul"),
             h("Softmax", ["ss"], ["p"], name="softmax", axis=-1), h("MatMul", ["p", "v"], ["a"], name="attn"),
             h("MatMul", ["a", "wo"], ["o"], name="o_proj"), h("Add", ["x", "o"], ["res1"], name="residual1"),
             h("LayerNormalization", ["res1", "ln_g", "ln_b"], ["n"], name="ln", axis=-1, epsilon=1e-5),
             h("MatMul", ["n", "w1"], ["f1"], name="ffn1"), h("Div", ["f1", "sqrt2"], ["d"], name="gelu_div"),
             h("Erf", ["d"], ["e"], name="gelu_erf"), h("Add", ["e", "one"], ["e1"], name="gelu_add"),
             h("Mul", ["f1", "e1"], ["fm"], name="gelu_mul"), h("Mul", ["fm", "half"], ["g"], name="gelu_half"),
             h("MatMul", ["g", "w2"], ["f2"], name="ffn2"), h("Add", ["res1", "f2"], ["y"], name="residual2")]
    if pooled:
        nodes[-1].output[0] = "r2"
        nodes.append(h("Einsum", ["r2"], ["y"], name="pool", equation="bsd->bd"))
    inits = [init("wq", rand((dim, dim), 11) * 0.3), init("wk", rand((dim, dim), 12) * 0.3),
             init("wv", rand((dim, dim), 13) * 0.3), init("wo", rand((dim, dim), 14) * 0.3),
             init("scale", np.float32(dim ** -0.5)), init("ln_g", rand((dim,), 15, positive=True)),
             init("ln_b", rand((dim,), 16) * 0.1), init("w1", rand((dim, 2 * dim), 17) * 0.3),
             init("sqrt2", np.float32(np.sqrt(2.0))), init("one", np.float32(1.0)), init("half", np.float32(0.5)),
             init("w2", rand((2 * dim, dim), 18) * 0.3)]
    out = [1, dim] if pooled else [1, seq, dim]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits, name="block")


def perturbed(model: onnx.ModelProto, initializer: str, delta: float = 0.5) -> onnx.ModelProto:
    """A copy with `delta` added to every element of one initializer."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name == initializer:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + np.float32(delta), initializer))
            return out
    raise KeyError(initializer)


def outlier_conv_net() -> onnx.ModelProto:
    """conv_net whose conv2 is INT8-hostile: conv1's channel 0 carries a bias of 1000 (damped by tiny conv2
    weights), so a per-tensor s8 scale on conv2's input (~8) rounds every other channel (~1) to zero."""
    model = conv_net()
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t).copy()
        if t.name == "b1":
            a[0] = 1000.0
        elif t.name == "w2":
            a[:, 0] *= 1e-3
        else:
            continue
        t.CopyFrom(numpy_helper.from_array(a, t.name))
    return model
