"""Index-driven ops and float predicates against onnxruntime: GatherND, GatherElements, ScatterND,
ScatterElements, CumSum, Trilu, OneHot, DepthToSpace, SpaceToDepth, EyeLike, IsNaN, IsInf."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def check(node, inputs: dict[str, np.ndarray], inits=(), out_type=F, opset: int = 17):
    elem = {np.dtype(np.float32): F, np.dtype(np.int64): I64, np.dtype(bool): TensorProto.BOOL}
    ins = [helper.make_tensor_value_info(k, elem[v.dtype], list(v.shape)) for k, v in inputs.items()]
    model = make_model([node], ins, [helper.make_tensor_value_info("y", out_type, None)], inits, opset=opset)
    got = kiln.build(model, autotune=False).run(inputs)["y"]
    assert_close_to_ort(got, run_ort(model, inputs)[0])


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(batch_dims):
    idx = np.array([[[0, 1], [1, -1]], [[1, 0], [0, 2]]], np.int64)[..., : 2 - batch_dims]
    check(helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims), {"x": rand((2, 3, 4))},
          [init("i", idx)])


def test_gather_elements_negative_indices():
    check(helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1), {"x": rand((3, 4))},
          [init("i", np.array([[0, -1], [2, 1], [3, 0]], np.int64))])


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max"])
def test_scatter_nd(reduction):
    idx = np.array([[0, 1], [2, 3], [0, 1]] if reduction != "none" else [[0, 1], [2, 3]], np.int64)
    upd = rand((len(idx), 5), seed=1)
    check(helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction=reduction), {"x": rand((3, 4, 5))},
          [init("i", idx), init("u", upd)], opset=18)


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements(reduction):
    check(helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0, reduction=reduction),
          {"x": rand((3, 3))}, [init("i", np.array([[1, 0, 2], [0, 2, 1]], np.int64)), init("u", rand((2, 3), 2))],
          opset=18)


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive, reverse):
    check(helper.make_node("CumSum", ["x", "a"], ["y"], exclusive=exclusive, reverse=reverse), {"x": rand((3, 5))},
          [init("a", np.array(1, np.int64))])


def test_cumsum_int64_positions():   # RoBERTa-style position ids: cumsum(mask) * mask
    check(helper.make_node("CumSum", ["x", "a"], ["y"]), {"x": np.array([[1, 1, 0], [1, 0, 0]], np.int64)},
          [init("a", np.array(1, np.int64))], out_type=I64)


@pytest.mark.parametrize("upper, k", [(1, 0), (0, 0), (1, 1), (0, -1)])
def test_trilu(upper, k):
    check(helper.make_node("Trilu", ["x", "k"], ["y"], upper=upper), {"x": rand((2, 4, 5))},
          [init("k", np.array(k, np.int64))])


def test_one_hot():
    check(helper.make_node("OneHot", ["i", "d", "v"], ["y"], axis=-1), {"i": np.array([[0, 2], [-1, 1]], np.int64)},
          [init("d", np.array(3, np.int64)), init("v", np.array([0.5, 2.0], np.float32))])


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    check(helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode), {"x": rand((1, 8, 3, 4))})


def test_space_to_depth():
    check(helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2), {"x": rand((1, 3, 4, 6))})


def test_eye_like():
    check(helper.make_node("EyeLike", ["x"], ["y"], k=1), {"x": rand((3, 4))})


def test_is_nan_and_is_inf():
    x = rand((2, 5))
    x[0, 0], x[0, 1], x[1, 2] = np.nan, np.inf, -np.inf
    check(helper.make_node("IsNaN", ["x"], ["y"]), {"x": x}, out_type=TensorProto.BOOL)
    check(helper.make_node("IsInf", ["x"], ["y"], detect_negative=0), {"x": x}, out_type=TensorProto.BOOL)


@pytest.mark.parametrize("elem, dtype", [(TensorProto.INT32, np.int32), (TensorProto.FLOAT, np.float32),
                                          (TensorProto.INT64, np.int64)])
def test_range_keeps_its_input_dtype(elem, dtype):   # int32 shape arithmetic (tf2onnx) stays int32
    node = helper.make_node("Range", ["s", "l", "d"], ["y"])
    model = make_model([node], [], [helper.make_tensor_value_info("y", elem, None)],
                       [init("s", np.array(2, dtype)), init("l", np.array(12, dtype)), init("d", np.array(3, dtype))])
    got = kiln.build(model, autotune=False).run({})["y"]
    want = run_ort(model, {})[0]
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(got, want)
