"""The Open Inference Protocol's tensor datatypes ("FP32", "INT64", "BOOL", "BYTES", ...) and numpy's, both ways."""
from __future__ import annotations

import ml_dtypes  # noqa: F401  (np.dtype("bfloat16"))
import numpy as np

from kiln.errors import InputError

OIP_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype("bfloat16"), "BYTES": np.dtype(object),
}
NUMPY_TO_OIP: dict[np.dtype, str] = {dtype: name for name, dtype in OIP_TO_NUMPY.items()}


def oip_datatype(dtype: str | np.dtype) -> str:
    """The protocol's name of a numpy dtype (an engine tensor's "float32" -> "FP32")."""
    try:
        return NUMPY_TO_OIP[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise InputError(f"dtype {dtype} has no Open Inference Protocol datatype") from None


def numpy_dtype(datatype: str, where: str) -> np.dtype:
    """numpy's dtype for a protocol datatype; an InputError naming `where` (e.g. "input 'x'") otherwise."""
    try:
        return OIP_TO_NUMPY[datatype]
    except (KeyError, TypeError):
        raise InputError(f"{where}: unknown datatype {datatype!r}; expected one of "
                         f"{', '.join(OIP_TO_NUMPY)}") from None


def encode_bytes_tensor(array: np.ndarray) -> bytes:
    """A BYTES tensor in the binary form: each element as a 4-byte little-endian length and its bytes."""
    parts = []
    for item in array.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += [len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def decode_bytes_tensor(data: bytes, count: int, where: str) -> np.ndarray:
    """The inverse of `encode_bytes_tensor` for `count` elements; an InputError if the bytes do not hold them."""
    items, offset = [], 0
    for _ in range(count):
        if offset + 4 > len(data):
            break
        size = int.from_bytes(data[offset:offset + 4], "little")
        if offset + 4 + size > len(data):
            break
        items.append(data[offset + 4:offset + 4 + size])
        offset += 4 + size
    if len(items) != count or offset != len(data):
        raise InputError(f"{where}: BYTES data does not hold {count} length-prefixed element(s) in "
                         f"{len(data)} bytes")
    return np.array(items, dtype=object)
