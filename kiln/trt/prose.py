"""TensorRT's prose read back into kiln's facts: the precision a `Format/Datatype` text names, the precision of a
kiln dtype under the same names, and the ONNX origins in a layer's `Metadata` (writer and reader side by side).
To be merged with `kiln.trt.vocab`, which writes the prose."""
from __future__ import annotations

import re

import numpy as np

METADATA_SEP = "\u001e"
_ONNX_LAYER = re.compile(r"\[ONNX Layer: (.*?)\]")

# Datatype words found in "Format/Datatype" strings and Myelin short types -> canonical precision names.
_PRECISION_WORDS = [("BFloat16", "BF16"), ("FP8", "FP8"), ("FP16", "FP16"), ("Half", "FP16"), ("FP32", "FP32"),
                    ("Float", "FP32"), ("Int8", "INT8"), ("INT8", "INT8"), ("Int32", "INT32"), ("Int64", "INT64"),
                    ("UInt8", "UINT8"), ("BOOL", "BOOL"), ("Bool", "BOOL"), ("Double", "FP64"), ("Int4", "INT4")]
_PRECISION_PATTERNS = [(re.compile(rf"\b{word}\b"), name) for word, name in _PRECISION_WORDS]

# A kiln tensor's dtype -> the precision name `precision_of` gives its `Format/Datatype` text. float64 has none:
# its text ("Row major linear FP64 format") names no precision the reader knows, so it reads as unknown.
DTYPE_PRECISION = {np.dtype("float32"): "FP32", np.dtype("float16"): "FP16", np.dtype("int8"): "INT8",
                   np.dtype("uint8"): "UINT8", np.dtype("int32"): "INT32", np.dtype("int64"): "INT64",
                   np.dtype("bool"): "BOOL"}


def precision_of(format_datatype: str | None) -> str | None:
    """"Row major linear FP32" -> "FP32"; "Thirty-two wide channel vectorized row major Int8 format" -> "INT8";
    "Half" -> "FP16"; None when unknown (e.g. "N/A due to dynamic shapes")."""
    if not format_datatype:
        return None
    for pattern, name in _PRECISION_PATTERNS:
        if pattern.search(format_datatype):
            return name
    return None


def dtype_precision(dtype: str) -> str | None:
    """A kiln tensor dtype ("float32", "int8", ...) -> its precision name ("FP32", "INT8"); None when it has none."""
    try:
        return DTYPE_PRECISION.get(np.dtype(dtype))
    except TypeError:
        return None


def metadata_text(origins: tuple[str, ...]) -> str:
    """A layer's ONNX origins as TensorRT's `Metadata`: "[ONNX Layer: a]\\u001e[ONNX Layer: b]"."""
    return METADATA_SEP.join(f"[ONNX Layer: {o}]" for o in origins)


def origins_from_metadata(metadata: str | None) -> tuple[str, ...]:
    """TensorRT's Metadata "[ONNX Layer: a]\\u001e[ONNX Layer: b]" -> ("a", "b")."""
    if not metadata:
        return ()
    found = _ONNX_LAYER.findall(metadata)
    return tuple(found) if found else tuple(p for p in metadata.split(METADATA_SEP) if p)
