"""Reference semantics of every ONNX op kiln supports: one `OpDef` per op, each with a category (TVM-style).

An op's `impl(attrs, inputs)` takes torch tensors (host inputs already converted to Python lists) and
returns a list of tensors. The same function does constant folding, shape inference (on meta tensors)
and serves as the always-available "reference" tactic.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch


class OpKind(str, Enum):
    """Fusion categories: which ops a pointwise chain may absorb, which layer may absorb what follows."""

    ELEMENTWISE = "elementwise"   # same-shape or broadcast, one output element from one element of each input
    INJECTIVE = "injective"       # data movement: reshape, transpose, slice, concat, gather
    REDUCTION = "reduction"       # pooling, softmax, reductions
    COMPLEX = "complex"           # conv, gemm, matmul: can absorb elementwise ops after them
    SHAPE = "shape"               # produces shape information only
    OPAQUE = "opaque"


Impl = Callable[[dict[str, Any], list[Any]], list[torch.Tensor]]


@dataclass(frozen=True)
class OpDef:
    op_type: str
    kind: OpKind
    impl: Impl
    host_inputs: tuple[int, ...] = ()   # inputs that must be build-time constants (shapes, axes, pads)
    # once per engine, not per inference: turn constant inputs into the form `impl` runs fastest with
    prepare_consts: Callable[[dict[str, Any], dict[int, torch.Tensor]], dict[int, torch.Tensor]] | None = None


OPS: dict[str, OpDef] = {}
MS_OPS: dict[str, OpDef] = {}   # onnxruntime's com.microsoft contrib ops that its quantizer writes
KILN_OPS: dict[str, OpDef] = {}  # kiln's own layer ops (domain "kiln"), filled by kiln.ops.fused


def register(op_type: str, kind: OpKind, host_inputs: tuple[int, ...] = ()):
    def wrap(fn: Impl) -> Impl:
        OPS[op_type] = OpDef(op_type, kind, fn, host_inputs)
        return fn
    return wrap


def lookup(op_type: str, domain: str = "") -> OpDef | None:
    if domain == "kiln":
        return KILN_OPS.get(op_type)
    if domain == "com.microsoft":
        return MS_OPS.get(op_type)
    if domain not in ("", "ai.onnx"):
        return None
    return OPS.get(op_type)


def register_ms(op_type: str, kind: OpKind):
    def wrap(fn: Impl) -> Impl:
        MS_OPS[op_type] = OpDef(op_type, kind, fn, ())
        return fn
    return wrap



def host_value(x: Any) -> Any:
    if x is None or isinstance(x, (list, int, float)):
        return x
    return x.tolist()
