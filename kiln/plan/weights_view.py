"""Reads the safetensors weights of an engine file as numpy views into the file's buffer: no copy, no pickle.

safetensors' own loader copies every tensor (0.8 s for BERT-base's 440 MB); a view costs nothing. The header is
untrusted input: every dtype, shape and byte range is checked before a view is made.
"""
from __future__ import annotations

import json
import struct

import numpy as np

from kiln.errors import EngineFormatError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}
MAX_HEADER_BYTES = 100 << 20


def weight_views(buffer: memoryview) -> dict[str, np.ndarray]:
    """name -> array viewing `buffer` (copied only where a tensor's bytes are misaligned for its dtype)."""
    if len(buffer) < 8:
        raise EngineFormatError("weights section is shorter than its 8-byte header length")
    (header_len,) = struct.unpack_from("<Q", buffer)
    if header_len > min(MAX_HEADER_BYTES, len(buffer) - 8):
        raise EngineFormatError(f"weights header length {header_len} exceeds the weights section ({len(buffer)} bytes)")
    header = json.loads(bytes(buffer[8:8 + header_len]))
    if not isinstance(header, dict):
        raise EngineFormatError("weights header is not a JSON object")
    data = buffer[8 + header_len:]
    base = np.frombuffer(data, np.uint8)
    return {name: _view(name, entry, base) for name, entry in header.items() if name != "__metadata__"}


def _view(name: str, entry: dict, base: np.ndarray) -> np.ndarray:
    dtype = DTYPES.get(entry.get("dtype") if isinstance(entry, dict) else None)
    if dtype is None:
        raise EngineFormatError(f"weight '{name}' has an unsupported or missing dtype")
    shape = tuple(int(d) for d in entry.get("shape", ()))
    begin, end = (int(x) for x in entry.get("data_offsets", ()))
    if any(d < 0 for d in shape) or not 0 <= begin <= end <= len(base):
        raise EngineFormatError(f"weight '{name}' has a negative dimension or a byte range outside the weights")
    count = int(np.prod(shape, dtype=np.int64))
    if (end - begin) != count * np.dtype(dtype).itemsize:
        raise EngineFormatError(f"weight '{name}': shape {list(shape)} needs {count * np.dtype(dtype).itemsize} "
                                f"bytes, its byte range holds {end - begin}")
    raw = base[begin:end]
    if raw.ctypes.data % np.dtype(dtype).alignment:
        raw = raw.copy()
    return raw.view(dtype).reshape(shape)
