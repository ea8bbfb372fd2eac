"""kiln.trt.vocab: precision names read from TensorRT's prose, the same names for kiln's dtypes, Metadata origins."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.plan.model import HWC, LINEAR, TensorDesc
from kiln.trt.vocab import dtype_precision, metadata_text, origins_from_metadata, precision_of
from kiln.trt.vocab import format_datatype


@pytest.mark.parametrize("text, precision", [
    ("Row major linear FP32", "FP32"), ("Channel major FP16 format", "FP16"), ("Half", "FP16"), ("Float", "FP32"),
    ("Thirty-two wide channel vectorized row major Int8 format", "INT8"), ("Row major linear UInt8 format", "UINT8"),
    ("Row major linear BOOL", "BOOL"), ("Row major linear Int64 format", "INT64"), ("BFloat16", "BF16"),
    ("N/A due to dynamic shapes", None), ("", None), (None, None), ("Row major linear FP64 format", None),
])
def test_precision_of_prose(text, precision):
    assert precision_of(text) == precision


@pytest.mark.parametrize("dtype, precision", [
    ("float32", "FP32"), ("float16", "FP16"), ("int8", "INT8"), ("uint8", "UINT8"), ("int32", "INT32"),
    ("int64", "INT64"), ("bool", "BOOL"), ("float64", None), ("int16", None), ("uint16", None),
])
@pytest.mark.parametrize("layout", [LINEAR, HWC])
def test_a_dtype_has_the_precision_its_prose_reads_as(dtype, precision, layout):
    """kiln's engines take a tensor's precision from its dtype; a layer-info export of the same tensor gives the
    prose. Both must name the same precision, or the inspector would see two engines in one."""
    t = TensorDesc("t", (1, 8, 4, 4), dtype, layout)
    assert dtype_precision(dtype) == precision
    assert precision_of(format_datatype(t)) == precision


def test_unknown_dtype_has_no_precision():
    assert dtype_precision("no-such-type") is None
    assert dtype_precision(np.dtype("complex64")) is None


def test_metadata_round_trip():
    origins = ("/stem/Conv", "relu 1")
    text = metadata_text(origins)
    assert text == "[ONNX Layer: /stem/Conv]\u001e[ONNX Layer: relu 1]"
    assert origins_from_metadata(text) == origins
    assert origins_from_metadata(metadata_text(())) == ()
    assert origins_from_metadata("plain\u001enames") == ("plain", "names")   # Metadata without the ONNX wrapper
