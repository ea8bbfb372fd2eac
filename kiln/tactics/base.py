"""The tactic interface: one kernel implementation for a layer, with the tensor formats it reads and writes."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from kiln import hardware

LINEAR, HWC, ANY = "linear", "hwc", "any"
MEMORY_ORDER = {LINEAR: (0, 1, 2, 3), HWC: (0, 2, 3, 1)}   # a 4-D tensor's axes in memory order, per layout

Kernel = Callable[[list[torch.Tensor | None]], list[torch.Tensor]]


@dataclass(frozen=True)
class LayerView:
    """What a tactic sees of a layer at build time and at load time."""

    op_type: str
    domain: str
    attrs: dict[str, Any]
    input_shapes: tuple[tuple[int, ...] | None, ...]
    input_dtypes: tuple[str | None, ...]
    const_inputs: dict[int, Any] = field(default_factory=dict)   # index -> torch tensor (weights)
    output_dtypes: tuple[str, ...] = ("float32",)
    opset: int = 17
    input_dynamic: tuple[tuple[int, ...], ...] = ()   # per input: axes that vary with the input shapes

    def input_spec(self, i: int) -> tuple[int, ...] | None:
        """Input i's shape with -1 on dynamic axes."""
        shape, dyn = self.input_shapes[i], self.input_dynamic[i] if i < len(self.input_dynamic) else ()
        return None if shape is None else tuple(-1 if k in dyn else d for k, d in enumerate(shape))


def batch_dynamic_only(layer: LayerView) -> bool:
    """Whether the layer's inputs vary with the input shapes along axis 0 (the batch) at most: kernels that read
    the batch per call, everything else fixed at load, take such layers."""
    return all(set(axes) <= {0} for axes in layer.input_dynamic)


STORED_FLOATS = ("float32", "bfloat16")   # the types a plan stores float tensors in (kiln.tactics.storage)


def has_residual(layer: LayerView) -> bool:
    """Whether a convolution or linear layer adds a fused residual (input 3, kiln.passes.conv.fuse_residual_add)."""
    return len(layer.input_shapes) > 3 and layer.input_shapes[3] is not None


def storage_dtype(dtype: str | None) -> torch.dtype:
    """The torch dtype of a plan tensor a kernel writes: bf16 where the plan stores it so, else FP32."""
    return torch.bfloat16 if dtype == "bfloat16" else torch.float32


def requantizing_params(quant: dict) -> torch.Tensor:
    """An INT8-in, INT8-out C kernel's quantization (pool.c's and resize.c's `q`): x_scale / y_scale, x_zero_point,
    y_zero_point, x signed, y signed, as float64."""
    return torch.tensor([float(quant["x_scale"]) / float(quant["y_scale"]), quant["x_zero_point"],
                         quant["y_zero_point"], quant["x_dtype"] == "int8", quant["y_dtype"] == "int8"],
                        dtype=torch.float64)


def unit_inner(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its last axis, as C kernels reading rows in place need (a copy where it lacks it)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def stored_channel_major(x: torch.Tensor | None) -> bool:
    """A 4-D tensor stored channel-major (NHWC) and not also row-major."""
    return x is not None and x.dim() == 4 and not x.is_contiguous() and \
        x.is_contiguous(memory_format=torch.channels_last)


def row_major_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of `shape`, in elements."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def bf16_io(layer: LayerView) -> int:
    """The `io` bits kiln's C kernels take for storage types: 1 where the first input is stored bf16, 2 where the
    output is (else FP32); a kernel's own flags go above them."""
    return int(layer.input_dtypes[0] == "bfloat16") | 2 * int(layer.output_dtypes[0] == "bfloat16")


@dataclass(frozen=True)
class CallLink:
    """A C kernel of kiln's own as kiln.runtime.chains runs it inside a run of oneDNN primitives (onednn.h's
    ChainFn: params, x, a second input or NULL, y): its function's address, `bind(x shape)` -> (its int64
    parameters for that shape, the output's shape and strides), whether it reads a second input (argument 1), the
    dtype it writes. It reads its inputs as the plan stores them, row-major."""

    function: int
    bind: Callable[[torch.Size], tuple[torch.Tensor, tuple, tuple]]
    second: bool
    out_dtype: torch.dtype
    lock: Any
    memory_format: torch.memory_format = torch.contiguous_format
    x_dtype: None = None   # as stored: no cast on the way in
    residual: int = 0      # nothing summed in place (onednn_prim's R_NONE)
    table: None = None

    @property
    def second_at(self) -> int | None:
        """The argument it reads besides its input: argument 1, where it reads one."""
        return 1 if self.second else None


class Bf16Storage:
    """Mixin for a tactic granted BF16 that computes in FP32 (or only moves data) and reads and writes tensors as a
    BF16 plan stores them, widening bf16 as it loads and rounding its output as it stores. Like every BF16 tactic it
    is offered only where the CPU computes BF16 natively (elsewhere --bf16 is denied with that reason); needing no
    instruction of its own, it runs unchanged where an engine built with it is loaded on another CPU."""

    reduced_precisions = frozenset({"BF16"})
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        return hardware.has_any(hardware.BF16_ISA) and super().supports(layer)


class Tactic(Protocol):
    name: str
    source: str

    def supports(self, layer: LayerView) -> bool: ...

    def input_formats(self, layer: LayerView) -> list[str]: ...

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str: ...

    def prepare(self, layer: LayerView) -> Kernel: ...


def tactic_value(name: str) -> int:
    """A stable 64-bit identifier for a tactic name (TensorRT's TacticValue)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def conv1d_as_2d(layer: LayerView) -> LayerView:
    """A 1-D convolution layer as the 2-D one over [N, C, 1, L] it equals: a unit kernel row, no padding, stride or
    dilation along the added axis."""
    a = layer.attrs
    pads, k = list(a.get("pads") or [0, 0]), layer.const_inputs[1].shape[-1] if 1 in layer.const_inputs else None
    attrs = {**a, "pads": [0, pads[0], 0, pads[1]], "strides": [1, *a.get("strides", [1])],
             "dilations": [1, *a.get("dilations", [1])], **({"kernel_shape": [1, k]} if k is not None else {})}
    shapes = tuple(s if s is None or len(s) != 3 else (*s[:2], 1, s[2]) for s in layer.input_shapes)
    dynamic = tuple(tuple(d + (d >= 2) for d in axes) for axes in layer.input_dynamic)
    consts = {i: (t[:, :, None] if i == 1 else t) for i, t in layer.const_inputs.items()}
    return replace(layer, attrs=attrs, input_shapes=shapes, input_dynamic=dynamic, const_inputs=consts)


class RowMajor1d:
    """Mixin: a 1-D convolution tactic on its 2-D parent, which sees the layer as conv1d_as_2d's [N, C, 1, L];
    row-major in and out (the subclass's `prepare` moves the data between the two)."""

    def supports(self, layer: LayerView) -> bool:
        return len(layer.input_shapes[0] or ()) == 3 and super().supports(conv1d_as_2d(layer))

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR
