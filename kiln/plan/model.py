"""The frozen engine plan: layers with chosen tactics, tensor descriptions, weights and the memory plan."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes  # noqa: F401  (registers np.dtype("bfloat16"): tensors kiln stores in BF16 between layers)
import numpy as np


LINEAR, HWC = "linear", "hwc"
Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    """The shapes one input may take in one optimization profile, bounds inclusive per axis."""

    min: Shape
    opt: Shape
    max: Shape

    def contains(self, shape: Shape) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max))

    def text(self) -> str:
        return "[" + ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(self.min, self.max)) + "]"


@dataclass(frozen=True)
class TensorDesc:
    """A tensor as the engine sees it: `dims` at the optimization profile's opt point, `dynamic` the axes
    that vary with the input shapes (layer info shows them as -1, as TensorRT does)."""

    name: str
    dims: tuple[int, ...]
    dtype: str
    format: str = LINEAR
    dynamic: tuple[int, ...] = ()

    @property
    def shape_spec(self) -> tuple[int, ...]:
        return tuple(-1 if i in self.dynamic else d for i, d in enumerate(self.dims))

    @property
    def size_bytes(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Arg:
    """One positional input of a layer's kernel: an activation tensor, a weight, or absent."""

    kind: str          # "tensor" | "weight" | "none"
    name: str = ""


@dataclass(frozen=True)
class Layer:
    """One step of the plan: an op (ONNX's or kiln's own) run by one tactic (kernel) of one tactic source."""

    name: str
    op_type: str
    domain: str
    args: tuple[Arg, ...]
    inputs: tuple[TensorDesc, ...]  # activation inputs, in argument order
    outputs: tuple[TensorDesc, ...]
    attrs: dict[str, Any]
    tactic_name: str
    tactic_value: int
    source: str                     # the tactic source (kiln, torch-onednn, onnxruntime, ...); "" for built-ins
    origin: tuple[str, ...]         # the ONNX nodes this layer computes
    precision: str = "FP32"           # granted precision
    inner: tuple["Layer", ...] = ()   # the layers a region runs as one unit ({ForeignNode[first...last]})
    requested_precision: str = ""     # what the build asked for (flags, per-layer constraints, Q/DQ)
    precision_reason: str = ""        # why the granted precision differs from the requested one


@dataclass(frozen=True)
class MemoryPlan:
    """Activation arena: each tensor's byte offset; tensors whose lifetimes do not overlap share bytes."""

    total_bytes: int
    unshared_bytes: int
    offsets: dict[str, int]
    free_after: tuple[tuple[str, ...], ...]   # per layer: tensors whose last use is that layer


@dataclass(frozen=True)
class Plan:
    name: str
    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
    layers: tuple[Layer, ...]
    weights: dict[str, np.ndarray]
    memory: MemoryPlan
    build_info: dict[str, Any] = field(default_factory=dict)
    profiles: tuple[dict[str, Any], ...] = ()   # optimization profiles: input -> ShapeRange (dynamic engines)

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())
