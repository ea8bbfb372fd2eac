"""Data-type tables: ONNX element types, numpy dtypes, torch dtypes and TensorRT's names for them."""
from __future__ import annotations

import ml_dtypes  # noqa: F401  (np.dtype("bfloat16"))
import numpy as np
import torch
from onnx import TensorProto

ONNX_TO_NUMPY: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype("float32"),
    TensorProto.DOUBLE: np.dtype("float64"),
    TensorProto.FLOAT16: np.dtype("float16"),
    TensorProto.BFLOAT16: np.dtype("bfloat16"),   # ml_dtypes': bfloat16 models' inputs, outputs and weights
    TensorProto.INT64: np.dtype("int64"),
    TensorProto.INT32: np.dtype("int32"),
    TensorProto.INT16: np.dtype("int16"),
    TensorProto.UINT16: np.dtype("uint16"),   # 16-bit Q/DQ (onnxruntime's QUInt16 activations)
    TensorProto.INT8: np.dtype("int8"),
    TensorProto.UINT8: np.dtype("uint8"),
    TensorProto.BOOL: np.dtype("bool"),
}

# 4-bit weights (weight-only quantization, opset 21) are read widened; the frontend lets only DequantizeLinear read them
FOUR_BIT_TO_NUMPY: dict[int, np.dtype] = {TensorProto.INT4: np.dtype("int8"), TensorProto.UINT4: np.dtype("uint8")}


def widen_four_bit(value: np.ndarray) -> np.ndarray:
    """A 4-bit array (onnx reads INT4/UINT4 tensors as ml_dtypes' int4/uint4) as int8/uint8; any other unchanged."""
    widened = _WIDENED.get(value.dtype.name)
    return value if widened is None else value.astype(widened)


_WIDENED = {"int4": np.dtype("int8"), "uint4": np.dtype("uint8")}

NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {
    np.dtype("float32"): torch.float32,
    np.dtype("float64"): torch.float64,
    np.dtype("float16"): torch.float16,
    np.dtype("int64"): torch.int64,
    np.dtype("int32"): torch.int32,
    np.dtype("int16"): torch.int16,
    np.dtype("uint16"): torch.uint16,   # torch's support is partial: kiln only moves it and converts it (Q/DQ)
    np.dtype("int8"): torch.int8,
    np.dtype("uint8"): torch.uint8,
    np.dtype("bool"): torch.bool,
    np.dtype("bfloat16"): torch.bfloat16,   # ml_dtypes' (kiln.plan.model): tensors stored in BF16 between layers
}
TORCH_TO_NUMPY = {t: n for n, t in NUMPY_TO_TORCH.items()}
INT8_TORCH: dict[str, torch.dtype] = {"uint8": torch.uint8, "int8": torch.int8}   # kiln's INT8 layers' types by name

BFLOAT16 = np.dtype("bfloat16")


def is_float(dtype) -> bool:
    """Whether a numpy dtype holds floats: numpy's own (kind "f") and ml_dtypes' bfloat16 (kind "V")."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == BFLOAT16


def raw_bfloat16(array: np.ndarray) -> np.ndarray:
    """`array` as bfloat16 where it holds bfloat16's raw 2-byte pattern: np.savez writes ml_dtypes' bfloat16 as
    void, so an .npz of bfloat16 arrays loads back as `|V2`. Any other array is returned as it is."""
    return array.view(BFLOAT16) if array.dtype.kind == "V" and array.dtype.itemsize == 2 else array


def tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy, also for bfloat16 arrays (torch reads them through their 16-bit pattern)."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Tensor.numpy(), also for bfloat16 tensors (an ml_dtypes bfloat16 array over the same bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def onnx_to_numpy(elem_type: int, where: str) -> np.dtype:
    from kiln.errors import ModelError

    if elem_type not in ONNX_TO_NUMPY:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise ModelError(f"{where}: element type {name} is not supported (supported: float32/16/64, bfloat16, "
                         "int8-64, uint8/16, bool)")
    return ONNX_TO_NUMPY[elem_type]


def to_torch_dtype(dtype: np.dtype) -> torch.dtype:
    return NUMPY_TO_TORCH[np.dtype(dtype)]


def to_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return TORCH_TO_NUMPY[dtype]
