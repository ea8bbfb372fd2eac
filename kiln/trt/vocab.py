"""TensorRT's vocabulary for kiln's facts, written and read back side by side: layer kinds and runner names
(ParameterType, LayerType), data type names, `Format/Datatype` prose and the precision it names, tensor text in log
lines, activation names, and the ONNX origins in a layer's `Metadata`."""
from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from kiln.plan.model import HWC, Layer, TensorDesc

# TensorRT's DataType names as they appear in layer info ("Float", "Half", "Int8", ...).
WEIGHT_TYPE = {
    np.dtype("float32"): "Float", np.dtype("float16"): "Half", np.dtype("int8"): "Int8",
    np.dtype("int32"): "Int32", np.dtype("int64"): "Int64", np.dtype("bool"): "Bool", np.dtype("uint8"): "UInt8",
    np.dtype("float64"): "Double", np.dtype("bfloat16"): "BFloat16",
}
# Short names used in "Format/Datatype" strings.
FORMAT_TYPE = {
    np.dtype("float32"): "FP32", np.dtype("float16"): "FP16", np.dtype("int8"): "Int8",
    np.dtype("int32"): "Int32", np.dtype("int64"): "Int64", np.dtype("bool"): "Bool", np.dtype("uint8"): "UInt8",
    np.dtype("float64"): "FP64", np.dtype("bfloat16"): "BF16",
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

# TensorRT's "ParameterType" (the layer kind) of each op kiln lays out as a layer; ops not listed are ElementWise.
_KINDS: dict[str, tuple[str, ...]] = {
    "Activation": ("Clip", "Elu", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu", "Mish", "PRelu", "Relu", "Selu",
                   "Sigmoid", "Softplus", "Softsign", "Swish", "Tanh", "ThresholdedRelu", "QLinearLeakyRelu",
                   "QLinearSigmoid"),
    "Attention": ("Attention",),
    "Concatenation": ("Concat", "QLinearConcat", "QConcat"),
    "Constant": ("Constant",),
    "Convolution": ("Conv", "ConvInteger", "QLinearConv", "QConv", "DynamicQConv"),
    "CumulativeSum": ("CumSum",),
    "Deconvolution": ("ConvTranspose",),
    "Einsum": ("Einsum",),
    "Fill": ("ConstantOfShape", "EyeLike", "Range"),
    "ForeignNode": ("Region",),
    "Gather": ("Gather", "GatherElements", "GatherND"),
    "Identity": ("Dropout", "Identity"),
    "MatrixMultiply": ("Gemm", "MatMul", "MatMulInteger", "QLinearMatMul", "QGemm", "QMatMul", "DynamicQMatMul"),
    "Normalization": ("GroupNormalization", "InstanceNormalization", "LayerNormalization", "RMSNormalization",
                      "SkipLayerNormalization", "QLayerNorm"),
    "OneHot": ("OneHot",),
    "Padding": ("Pad",),
    "PointWise": ("PointWise",),
    "Pooling": ("AveragePool", "GlobalAveragePool", "GlobalMaxPool", "MaxPool", "QLinearGlobalAveragePool",
                "QAveragePool"),
    "Reduce": ("ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare"),
    "Reformat": ("DequantizeLinear", "DynamicQuantizeLinear", "QuantizeLinear", "Reformat"),
    "Resize": ("Resize", "QResize"),
    "Scale": ("BatchNormalization",),
    "Scatter": ("ScatterElements", "ScatterND"),
    "Select": ("Trilu",),
    "Shape": ("Shape", "Size"),
    "Shuffle": ("DepthToSpace", "Flatten", "Reshape", "SpaceToDepth", "Squeeze", "Transpose", "Unsqueeze", "Shuffle"),
    "Slice": ("Expand", "Slice", "Split", "Tile"),
    "SoftMax": ("LogSoftmax", "Softmax", "QSoftmax"),
    "TopK": ("ArgMax", "ArgMin", "TopK"),
    "Unary": ("Abs", "Ceil", "Cos", "Erf", "Exp", "Floor", "IsInf", "IsNaN", "Log", "Neg", "Not", "Reciprocal", "Round",
              "Sign", "Sin", "Sqrt"),
}
PARAMETER_TYPE = {op: kind for kind, ops in _KINDS.items() for op in ops}
# TensorRT's "LayerType" names the runner: kiln names the kernel library (the tactic) and the layer kind.
_RUNNERS = {**{f"onednn.{kernel}{bf16}": "OneDnnConvolution" for bf16 in ("", "_bf16")
               for kernel in ("conv2d_nhwc_prepacked", "conv1d_prepacked", "conv2d_primitive")},
            **{f"onednn.deconv{rank}_prepacked{bf16}": "OneDnnDeconvolution"
               for rank in ("2d_nhwc", "1d") for bf16 in ("", "_bf16")},
            **{f"onednn.linear_{kind}{bf16}": "OneDnnMatrixMultiply" for kind in ("prepacked", "primitive")
               for bf16 in ("", "_bf16")},
            "codegen.pointwise_c_simd": "PointWiseV2", "kiln.noop": "NoOp", "kiln.constant": "Constant"}
_LIBRARY_RUNNERS = {"onnxruntime": "OnnxRuntime", "openvino": "OpenVINO"}   # external libraries, by tactic source
WINOGRAD_TACTIC_PREFIX = "kiln.conv2d_winograd"


def parameter_type(layer: Layer) -> str:
    """TensorRT's "ParameterType" of a plan layer: the layer kind (Convolution, Pooling, Shuffle, ...)."""
    return PARAMETER_TYPE.get(layer.op_type, "ElementWise")


def runner_name(tactic_name: str, source: str, op_type: str) -> str:
    """TensorRT's "LayerType" for a tactic running an op: its runner. An external library's region is named after
    the library (`OpenVINO`), its inner layers and single layers after the library and the kind
    (`OnnxRuntimeConvolution`); kiln's own kernels by what they are (`WinogradConvolution`, `PointWiseV2`)."""
    kind = PARAMETER_TYPE.get(op_type, "ElementWise")
    library = _LIBRARY_RUNNERS.get(source)
    if library is not None:
        return library if op_type == "Region" else library + kind
    if tactic_name.startswith(WINOGRAD_TACTIC_PREFIX):   # every tile size
        return "WinogradConvolution"
    return _RUNNERS.get(tactic_name, kind)


def layer_type(layer: Layer) -> str:
    """TensorRT's "LayerType" of a plan layer (see `runner_name`)."""
    return runner_name(layer.tactic_name, layer.source, layer.op_type)

METADATA_SEP = "\u001e"
_ONNX_LAYER = re.compile(r"\[ONNX Layer: (.*?)\]")

# Datatype words found in "Format/Datatype" strings and Myelin short types -> canonical precision names.
_PRECISION_WORDS = [("BFloat16", "BF16"), ("BF16", "BF16"), ("FP8", "FP8"), ("FP16", "FP16"), ("Half", "FP16"), ("FP32", "FP32"),
                    ("Float", "FP32"), ("Int8", "INT8"), ("INT8", "INT8"), ("Int32", "INT32"), ("Int64", "INT64"),
                    ("UInt8", "UINT8"), ("BOOL", "BOOL"), ("Bool", "BOOL"), ("Double", "FP64"), ("Int4", "INT4")]
_PRECISION_PATTERNS = [(re.compile(rf"\b{word}\b"), name) for word, name in _PRECISION_WORDS]

# A kiln tensor's dtype -> the precision name `precision_of` gives its `Format/Datatype` text. float64 has none:
# its text ("Row major linear FP64 format") names no precision the reader knows, so it reads as unknown.
DTYPE_PRECISION = {np.dtype("float32"): "FP32", np.dtype("float16"): "FP16", np.dtype("int8"): "INT8",
                   np.dtype("uint8"): "UINT8", np.dtype("int32"): "INT32", np.dtype("int64"): "INT64",
                   np.dtype("bool"): "BOOL", np.dtype("bfloat16"): "BF16"}


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
    """A layer's ONNX origins as TensorRT's `Metadata`: "[ONNX Layer: a]\\u001e[ONNX Layer: b]", each once (the
    nodes one QOperator node unfolds into share it)."""
    return METADATA_SEP.join(f"[ONNX Layer: {o}]" for o in dict.fromkeys(origins))


def origins_from_metadata(metadata: str | None) -> tuple[str, ...]:
    """TensorRT's Metadata "[ONNX Layer: a]\\u001e[ONNX Layer: b]" -> ("a", "b")."""
    if not metadata:
        return ()
    found = _ONNX_LAYER.findall(metadata)
    return tuple(found) if found else tuple(p for p in metadata.split(METADATA_SEP) if p)


# ---- layer names: kiln names its layers as TensorRT does, so users' scripts and habits carry over ----------------
def fused_layer_name(parts: Iterable[str]) -> str:
    """A vertical fusion: "conv + bn + relu" (a node unfolded into several parts is named once)."""
    return " + ".join(dict.fromkeys(parts))


def merged_layer_name(parts: Iterable[str]) -> str:
    """A horizontal merge of layers sharing an input: "q || k || v"."""
    return " || ".join(dict.fromkeys(parts))


def pointwise_layer_name(parts: Iterable[str]) -> str:
    """A fused pointwise program: "PWN(Sigmoid, Mul)"."""
    return f"PWN({', '.join(dict.fromkeys(parts))})"


def region_layer_name(first: str, last: str) -> str:
    """A run of nodes one external library runs as one layer: "{ForeignNode[first...last]}"."""
    return f"{{ForeignNode[{first}...{last}]}}"


def reformat_names(direction: str, index: int, layer: str) -> tuple[str, str]:
    """(Reformat layer name, its output tensor's name) for a layout copy of `layer`'s input or output `index`."""
    return (f"Reformatting CopyNode for {direction} Tensor {index} to {layer}",
            f"Reformatted {direction} Tensor {index} to {layer}")


def is_reformat_name(name: str) -> bool:
    """Whether a layer name is one TensorRT (or kiln, following it) gives an inserted Reformat copy."""
    return name.startswith("Reformatting CopyNode")


# ---- TensorRT 11's inspector JSON: data types and formats as separate fields -------------------------------------
# A tensor's data type by name -> precision. TensorRT 11 names it in "DataType" (I/O tensors; NVIDIA's migration
# guide shows "Float") and "Datatype" (layer tensors; NVIDIA's Polygraphy and cookbook read that key). The guide
# does not list every value, so the DataType names layer info has always used ("Float", "Half", "Int8"), nvinfer1's
# enum spelling ("kFLOAT", "kHALF") and the short forms of the 10.x prose ("FP32", "FP16") are all accepted.
_DATATYPE_PRECISION = {
    "FLOAT": "FP32", "FP32": "FP32", "HALF": "FP16", "FP16": "FP16", "BFLOAT16": "BF16", "BF16": "BF16",
    "FP8": "FP8", "FLOAT8E4M3": "FP8", "FP4": "FP4", "E8M0": "E8M0", "INT8": "INT8", "INT4": "INT4",
    "INT32": "INT32", "INT64": "INT64", "UINT8": "UINT8", "BOOL": "BOOL", "DOUBLE": "FP64", "FP64": "FP64",
}
DATATYPE_NAMES = ("Float", "Half", "BFloat16", "FP8", "FP4", "E8M0", "Int8", "Int4", "Int32", "Int64", "UInt8", "Bool")
# kiln's tensor layout -> the TensorFormat enum TensorRT 11 appends to a format's prose: "... (kLINEAR)"
FORMAT_ENUM = {HWC: "kHWC"}
_FORMAT_ENUM_SUFFIX = re.compile(r"\s*\((k[A-Z0-9_]+)\)\s*$")
# ProfilingVerbosity as TensorRT 11 writes it at the top level; read in any case, with or without the "k" prefix
PROFILING_VERBOSITY_NAMES = {"none": "NONE", "layer_names_only": "LAYER_NAMES_ONLY", "detailed": "DETAILED"}


def datatype_precision(name: str) -> str | None:
    """"Float" / "kFLOAT" / "FP32" -> "FP32"; "N/A ..." -> None (not known); ValueError for a name TensorRT lacks."""
    text = name.strip()
    if text.upper().startswith("N/A"):
        return None
    key = text.upper()
    if key.startswith("K") and key[1:] in _DATATYPE_PRECISION:
        key = key[1:]
    if key not in _DATATYPE_PRECISION:
        raise ValueError(name)
    return _DATATYPE_PRECISION[key]


def format_text_11(t: TensorDesc) -> str:
    """TensorRT 11's "Format" of a tensor: the format's prose and its TensorFormat enum, "Row major linear FP32
    (kLINEAR)" (the form NVIDIA's migration guide shows for I/O tensors)."""
    return f"{format_datatype(t)} ({FORMAT_ENUM.get(t.format, 'kLINEAR')})"


def split_format_enum(text: str) -> tuple[str, str | None]:
    """"Row major linear FP32 format (kLINEAR)" -> ("Row major linear FP32 format", "kLINEAR")."""
    m = _FORMAT_ENUM_SUFFIX.search(text)
    return (text[:m.start()], m[1]) if m else (text, None)


def profiling_verbosity(name: str) -> str | None:
    """"DETAILED" / "kDETAILED" / "detailed" -> "detailed"; None when TensorRT has no such verbosity."""
    key = name.strip().lower()
    key = key[1:] if key.startswith("k") and key[1:] in PROFILING_VERBOSITY_NAMES else key
    return key if key in PROFILING_VERBOSITY_NAMES else None
