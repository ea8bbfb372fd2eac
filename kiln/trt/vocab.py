"""TensorRT's vocabulary for kiln's facts: data type names, `Format/Datatype` prose, tensor text in log lines."""
from __future__ import annotations

import numpy as np

from kiln.plan.model import HWC, TensorDesc

# TensorRT's DataType names as they appear in layer info ("Float", "Half", "Int8", ...).
WEIGHT_TYPE = {
    np.dtype("float32"): "Float", np.dtype("float16"): "Half", np.dtype("int8"): "Int8",
    np.dtype("int32"): "Int32", np.dtype("int64"): "Int64", np.dtype("bool"): "Bool", np.dtype("uint8"): "UInt8",
    np.dtype("float64"): "Double",
}
# Short names used in "Format/Datatype" strings.
FORMAT_TYPE = {
    np.dtype("float32"): "FP32", np.dtype("float16"): "FP16", np.dtype("int8"): "Int8",
    np.dtype("int32"): "Int32", np.dtype("int64"): "Int64", np.dtype("bool"): "Bool", np.dtype("uint8"): "UInt8",
    np.dtype("float64"): "FP64",
}
_LINEAR_TEXT = {"FP32": "Row major linear FP32", "Int32": "Row major linear Int32", "Bool": "Row major linear BOOL",
                "Int8": "Row major Int8 format"}


def weight_type(dtype) -> str:
    """numpy dtype -> TensorRT's DataType name ("Float", "Half", ...); unknown types keep numpy's name."""
    return WEIGHT_TYPE.get(np.dtype(dtype), str(dtype))


def format_datatype(t: TensorDesc) -> str:
    """TensorRT's "Format/Datatype" text for a tensor of kiln's plan (layout + dtype)."""
    short = FORMAT_TYPE.get(np.dtype(t.dtype), t.dtype)
    if t.format == HWC:
        return f"Channel major {short} format"
    return _LINEAR_TEXT.get(short, f"Row major linear {short} format")


def tensor_text(t: TensorDesc) -> str:
    """A tensor as TensorRT's verbose "Engine Layer Information" lines write it: `name[Float(1,64,-1,-1)]`."""
    return f"{t.name}[{weight_type(t.dtype)}({','.join(map(str, t.shape_spec))})]"


# ONNX activation op -> TensorRT ActivationType name (layer info "Activation" key).
ACTIVATION_TYPE: dict[str, str] = {
    "Relu": "RELU", "LeakyRelu": "LEAKY_RELU", "Clip": "CLIP", "Sigmoid": "SIGMOID", "Tanh": "TANH",
    "HardSigmoid": "HARD_SIGMOID", "Elu": "ELU", "Selu": "SELU", "Softplus": "SOFTPLUS", "Softsign": "SOFTSIGN",
    "ThresholdedRelu": "THRESHOLDED_RELU", "HardSwish": "HARD_SWISH", "Mish": "MISH", "Gelu": "GELU_ERF",
    "Swish": "SWISH",   # not a TensorRT ActivationType: TensorRT fuses SiLU as a PointWise epilogue
}
