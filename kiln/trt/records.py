"""One typed model for every engine description kiln reads: TensorRT layer info (JSON, one-line dumps),
kiln engines and exports, profiles, per-inference times and build logs. Rendering and lint read only this."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kiln.trt.vocab import is_reformat_name, precision_of

_CONV_KINDS = ("Convolution", "ConvActPool", "Deconvolution")
_GEMM_KINDS = ("MatrixMultiply", "Gemm", "FullyConnected")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...] | None = None          # -1 for dynamic dimensions
    format: str | None = None                    # TensorRT's "Format/Datatype" text (or a short dtype)
    location: str | None = None
    precision: str | None = None                 # "FP32", "INT8", ...; when not given, read from `format`

    def __post_init__(self):
        if self.precision is None:
            object.__setattr__(self, "precision", precision_of(self.format))

    @property
    def dynamic(self) -> bool:
        return self.dims is not None and any(d < 0 for d in self.dims)


@dataclass(frozen=True)
class LayerRecord:
    name: str
    layer_type: str | None = None                # the runner: CaskConvolution, Reformat, NoOp, Myelin, kgen, ...
    parameter_type: str | None = None            # the layer kind: Convolution, Pooling, Reformat, Shuffle, ...
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)   # every other key, as read
    tactic_name: str | None = None
    tactic_value: str | None = None
    origin: tuple[str, ...] = ()                 # ONNX node names (Metadata / kiln origin)
    region: str | None = None                    # the {ForeignNode[...]} this layer belongs to, if known

    @property
    def precision(self) -> str | None:
        """The layer's compute precision as the outputs (else inputs) show it."""
        for t in self.outputs + self.inputs:
            if t.precision:
                return t.precision
        return None

    @property
    def is_reformat(self) -> bool:
        return self.layer_type in ("Reformat", "NoOp") and (self.parameter_type in (None, "Reformat")) and \
            (is_reformat_name(self.name) or self.params.get("Origin") in ("REFORMAT", "QDQ")
             or self.layer_type == "Reformat")

    @property
    def fused_names(self) -> tuple[str, ...]:
        """The parts of a fused name: "a + b + c" -> (a, b, c); "a || b" -> (a, b)."""
        parts = re.split(r" \+ | \|\| ", self.name)
        return tuple(p for p in parts if p)


@dataclass(frozen=True)
class ProfileRecord:
    name: str
    time_ms: float
    average_ms: float
    median_ms: float | None
    percentage: float


@dataclass(frozen=True)
class Profile:
    count: int | None
    records: tuple[ProfileRecord, ...]

    @property
    def total_average_ms(self) -> float:
        return sum(r.average_ms for r in self.records)


@dataclass(frozen=True)
class InferenceTimes:
    latency_ms: tuple[float, ...]
    compute_ms: tuple[float, ...]
    key_set: str                                 # "trt8.4+", "trt8.0-8.3", "trt7"


@dataclass(frozen=True)
class ProfileShapes:
    """One optimization profile of an I/O tensor (TensorRT 11's "ProfileInfo" entry)."""

    min_dims: tuple[int, ...] | None = None
    opt_dims: tuple[int, ...] | None = None
    max_dims: tuple[int, ...] | None = None
    format: str | None = None                    # the format's prose, its " (kLINEAR)" enum split off


@dataclass(frozen=True)
class IOTensor:
    """An engine input or output as TensorRT 11's "I/O Tensors" describes it."""

    name: str
    io_mode: str | None = None                   # "Input" | "Output" as written
    data_type: str | None = None                 # as written: "Float", "Half", "kINT8", ...
    precision: str | None = None                 # "FP32", "FP16", "INT8", ... (read from data_type)
    dims: tuple[int, ...] | None = None
    location: str | None = None
    shape_inference_io: bool = False
    profiles: tuple[ProfileShapes, ...] = ()


@dataclass(frozen=True)
class EngineInfo:
    """An engine as described by one artifact (or a kiln engine file)."""

    source: str                                  # e.g. "trtexec-json", "trtexec-oneline", "kiln-engine"
    verbosity: str                               # "layer_names_only" | "detailed"
    layers: tuple[LayerRecord, ...]
    bindings: tuple[str, ...] = ()
    profile: Profile | None = None
    notes: tuple[str, ...] = ()                  # what the reader noticed (unknown keys, truncated lines, ...)
    io_tensors: tuple[IOTensor, ...] = ()        # TensorRT 11's "I/O Tensors" (10.x and older name only bindings)
    metadata: dict[str, Any] = field(default_factory=dict)   # TensorRT 11's "Engine Metadata"

    @property
    def layer_types(self) -> dict[str, int]:
        return dict(Counter(layer.layer_type or "unknown" for layer in self.layers))

    @property
    def precisions(self) -> dict[str, int]:
        return dict(Counter(layer.precision or "unknown" for layer in self.layers))


@dataclass(frozen=True)
class PassEvent:
    pass_name: str
    kind: str                                    # "running" | "fusing" | "removing" | "swapping" | "merging" | ...
    subjects: tuple[str, ...]


@dataclass(frozen=True)
class TacticChoice:
    layer: str
    runner: str | None
    tactic: str                                  # hex or decimal as printed
    time_ms: float | None


@dataclass(frozen=True)
class BuildLog:
    tool_version: str | None
    options: dict[str, str]                      # "=== Build Options ===" etc. key: value lines
    device: dict[str, str]
    events: tuple[PassEvent, ...]
    pass_counts: dict[str, int]                  # pass name -> number of "Running:" lines
    layer_trajectory: tuple[tuple[str, int], ...]   # ("Original", 755), ("After dead-layer removal", 755), ...
    tactic_choices: tuple[TacticChoice, ...]
    timings: tuple[tuple[str, str, float], ...]  # (layer/runner, tactic, time_ms) from "Tactic: ... Time: ..."
    memory: dict[str, str]
    performance: dict[str, str]                  # "=== Performance summary ===" lines
    engine: EngineInfo | None                    # an "Engine Layer Information" / "Layers:" dump, if present
    notes: tuple[str, ...] = ()


def is_conv(layer: LayerRecord) -> bool:
    """A convolution in any TensorRT version's vocabulary (ParameterType, runner name, or an unnamed layer's tag)."""
    return layer.parameter_type in _CONV_KINDS or layer.params.get("ConvParameterType") == "Convolution" or \
        "Conv" in (layer.layer_type or "") or (layer.parameter_type is None and "[Convolution]" in layer.name
                                                and not layer.is_reformat)


def is_gemm(layer: LayerRecord) -> bool:
    """A matrix product (MatrixMultiply, Gemm, FullyConnected, a Cask GEMM runner)."""
    return layer.parameter_type in _GEMM_KINDS or (layer.layer_type or "").lower() in ("gemm", "caskgemm") or \
        "Gemm" in (layer.layer_type or "") or "MatrixMultiply" in (layer.layer_type or "")


def is_reformat(layer: LayerRecord) -> bool:
    """A layout/precision copy TensorRT or kiln inserted."""
    return layer.is_reformat or layer.parameter_type == "Reformat" or is_reformat_name(layer.name)


def is_region(layer: LayerRecord) -> bool:
    """A fused region: kiln's or TensorRT's {ForeignNode[...]}, or a Myelin layer."""
    return "{ForeignNode[" in layer.name or (layer.layer_type or "").lower() == "myelin"
