"""Small engines for the serving tests, built once per session: a conv net with a dynamic batch axis (and
dynamic H/W), a static MLP, and an INT64-indexed table lookup with a BOOL output (out-of-range indices make its
kernel raise)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.conftest import init, make_model

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4) - 17.5
CONV_PROFILE = {"image": ((1, 3, 8, 8), (4, 3, 16, 16), (8, 3, 32, 32))}


def conv_model(path: Path) -> None:
    """Conv 3->8 + ReLU, global average pool, Gemm 8->5, softmax; image [N, 3, H, W] -> probs [N, 5]."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["image", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                       [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", 5])],
                       [init("w", rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3),
                        init("b", rng.standard_normal(8).astype(np.float32) * 0.1),
                        init("fc_w", rng.standard_normal((5, 8)).astype(np.float32)),
                        init("fc_b", rng.standard_normal(5).astype(np.float32) * 0.1)], name="conv")
    path.write_bytes(model.SerializeToString())


def mlp_model(path: Path) -> None:
    """A static MLP: x [2, 6] -> hidden [2, 4] (ReLU) and y [2, 3]."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "w2"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                       [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [2, 4]),
                        helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                       [init("w1", rng.standard_normal((6, 4)).astype(np.float32)),
                        init("w2", rng.standard_normal((4, 3)).astype(np.float32))], name="mlp")
    path.write_bytes(model.SerializeToString())


def lookup_model(path: Path) -> None:
    """idx INT64 [N] -> rows FP32 [N, 4] = TABLE[idx], positive BOOL [N, 4] = rows > 0."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Gather", ["table", "idx"], ["rows"], axis=0),
             helper.make_node("Greater", ["rows", "zero"], ["positive"])]
    model = make_model(nodes, [helper.make_tensor_value_info("idx", TensorProto.INT64, ["n"])],
                       [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 4]),
                        helper.make_tensor_value_info("positive", TensorProto.BOOL, ["n", 4])],
                       [init("table", TABLE), init("zero", np.zeros((), np.float32))], name="lookup")
    path.write_bytes(model.SerializeToString())


def build_engines(folder: Path) -> dict[str, Path]:
    """name -> engine path (and the ONNX file beside it, same stem)."""
    import kiln

    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, make, profiles in (("conv", conv_model, [CONV_PROFILE]), ("mlp", mlp_model, None),
                                 ("lookup", lookup_model, [{"idx": ((1,), (4,), (16,))}])):
        onnx_path = folder / f"{name}.onnx"
        make(onnx_path)
        engine = kiln.build(str(onnx_path), profiles=profiles or [], autotune=False)
        engine.save(folder / f"{name}.kiln")
        made[name] = folder / f"{name}.kiln"
    return made
