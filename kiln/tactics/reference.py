"""The reference tactic: any op's torch implementation from kiln.ops, valid for every layer and layout; and its
BF16 form for layers that only move data, so tensors between BF16 kernels stay bf16 through them."""
from __future__ import annotations

import torch

from kiln.ops import lookup
from kiln.ops.registry import host_value
from kiln.tactics.base import ANY, HWC, LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, storage_dtype

# Ops whose torch implementation is layout-transparent and cheap on channel-major tensors.
LAYOUT_AGNOSTIC = {"PointWise", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "QConcat",
                   "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
                   "BatchNormalization", "Conv", "Slice", "Split"}   # torch indexes logical axes in any layout


class ReferenceTactic:
    name = "torch.reference"
    source = "torch"
    outputs_as_planned = True   # torch's layout rules decide its outputs' layout: made the plan's (as_planned)

    def supports(self, layer: LayerView) -> bool:
        return lookup(layer.op_type, layer.domain) is not None

    def input_formats(self, layer: LayerView) -> list[str]:
        agnostic = layer.op_type in LAYOUT_AGNOSTIC or _is_elementwise(layer)
        return [ANY if agnostic else LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        agnostic = layer.op_type in LAYOUT_AGNOSTIC or _is_elementwise(layer)
        return HWC if agnostic and HWC in input_formats else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        opdef = lookup(layer.op_type, layer.domain)
        attrs = layer.attrs
        host = {i: host_value(t) for i, t in layer.const_inputs.items() if i in opdef.host_inputs}
        consts = {i: t for i, t in layer.const_inputs.items() if i not in opdef.host_inputs}
        if opdef.prepare_consts is not None:
            consts = opdef.prepare_consts(attrs, consts)
        impl = opdef.impl
        n = len(layer.input_shapes)
        runtime_host = [i for i in opdef.host_inputs if i < n and i not in host and layer.input_shapes[i] is not None]

        def run(xs):
            args = [host[i] if i in host else consts[i] if i in consts else xs[i] for i in range(n)]
            for i in runtime_host:   # shape arithmetic that depends on dynamic input axes
                args[i] = host_value(args[i])
            return impl(attrs, args)
        out_fn = WRITES_INTO.get(layer.op_type) if layer.domain in ("", "ai.onnx") and not host else None
        if out_fn is not None:
            def write_into(xs, out):
                """Elementwise arithmetic straight into `out` (a Concat's slice), where every operand is of its
                type; anything else computed, then copied."""
                args = [consts[i] if i in consts else xs[i] for i in range(n)]
                same = all(isinstance(a, torch.Tensor) and a.dtype == out.dtype for a in args)
                if same and out.is_floating_point() and (layer.op_type in EXACT or out.is_contiguous()):
                    out_fn(*args, out=out)
                else:
                    out.copy_(run(xs)[0])
            run.write_into = write_into
        return run


# ONNX elementwise ops whose torch function writes into a given tensor with ONNX's semantics on float operands.
# EXACT ones round correctly on any strides; torch's vectorized and strided loops of the others differ in the last
# bit, so they write only into contiguous slices (a view gives what the plan without elision gives).
EXACT = {"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt"}
WRITES_INTO = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Sigmoid": torch.sigmoid,
               "Tanh": torch.tanh, "Neg": torch.neg, "Abs": torch.abs, "Exp": torch.exp, "Sqrt": torch.sqrt}


# Layers that only move data or pick among values: on bf16 tensors they compute exactly what they do on FP32 ones,
# moving half the bytes.
MOVES_DATA = {"Concat", "Slice", "Split", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity",
              "Pad", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Gather", "GatherElements", "GatherND",
              "ReduceMax", "ReduceMin"}
# Layers that pick values and say where: the picked values as the plan stores them, the indices int64.
PICKS_WITH_INDICES = {"TopK", "ArgMax", "ArgMin"}
# Reductions that sum: granted BF16 they widen bf16 inputs to FP32, reduce in FP32 and round once as they store.
SUMS_IN_FP32 = {"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceProd", "CumSum"}
ONNX_BF16_OPS = frozenset(MOVES_DATA | PICKS_WITH_INDICES | SUMS_IN_FP32)
BF16_OPS = sorted(ONNX_BF16_OPS | {"Shuffle"})   # registry entries (Shuffle: kiln's)
MOVED_INPUTS = 64   # a Concat's inputs beyond these stay FP32 (the kernel rounds them as it copies)


class Bf16ReferenceTactic(Bf16Storage, ReferenceTactic):
    """torch's kernels for layers that only move data (Concat, Slice, Split, Reshape, Transpose, Pad, Expand, Tile,
    DepthToSpace, SpaceToDepth, Gather, kiln's Shuffle) or pick among values (ReduceMax/Min; TopK, ArgMax/ArgMin
    with int64 indices: ties among values equal once rounded to bf16 go to the lowest index), and for the summing
    reductions (ReduceMean/Sum/SumSquare/L2/Prod, CumSum: FP32 sums of widened inputs, one rounding), granted BF16:
    they read and write tensors as the plan stores them
    (kiln.tactics.storage), so a Concat of BF16 convolutions' outputs feeding BF16 convolutions copies bf16 and
    neither side converts (YOLOv8n's C2f blocks: ~5 % of its latency on kiln's own kernels). A Concat input stored
    otherwise than its output is converted first (a mixed torch.cat is ~10x slower); other layers' outputs are
    converted to their storage, exactly (a Pad's constant is rounded to bf16 as its output is). Residual Adds stay
    FP32: a bf16 residual stream costs transformers accuracy."""

    name = "torch.reference_bf16"
    bf16_inputs = frozenset(range(MOVED_INPUTS))
    writes_every_output = True   # a Split's outputs each stored as their readers take them

    def supports(self, layer: LayerView) -> bool:
        op = layer.op_type
        onnx_op = op in ONNX_BF16_OPS and layer.domain in ("", "ai.onnx")
        if not (onnx_op or (op, layer.domain) == ("Shuffle", "kiln")) or not layer.output_dtypes:
            return False
        data = layer.input_dtypes if op == "Concat" else layer.input_dtypes[:1]
        values = [d for d in layer.output_dtypes if d != "int64"] if op in PICKS_WITH_INDICES else layer.output_dtypes
        return all(d in STORED_FLOATS for d in (*data, *values)) and super().supports(layer)

    def prepare(self, layer: LayerView) -> Kernel:
        kernel = super().prepare(layer)
        outs = [storage_dtype(d) if d in STORED_FLOATS else None for d in layer.output_dtypes]   # None: indices
        if layer.op_type == "Concat" and any(storage_dtype(d) != outs[0] for d in layer.input_dtypes):
            inner, out = kernel, outs[0]

            def kernel(xs):
                return inner([x if x is None or x.dtype == out else x.to(out) for x in xs])   # None: a constant
        elif layer.op_type in SUMS_IN_FP32:
            inner = kernel

            def kernel(xs):
                return inner([x.float() if x is not None and x.dtype == torch.bfloat16 else x for x in xs])

        def run(xs):
            return [y if dtype is None or y.dtype == dtype else y.to(dtype) for y, dtype in zip(kernel(xs), outs)]
        return run


def as_planned(kernel: Kernel, output_formats: list[str]) -> Kernel:
    """A reference kernel as the plan runs it: torch returns some results as views in another layout (a channel
    slice of a channel-major tensor), and a 4-D output the plan records channel-major is copied so (no copy when it
    already is). The runtime runs reference kernels this way and the autotuner times them so: timing the view alone
    made a YOLOv8n Slice look free (5 µs) where it cost 0.11 ms in the plan."""
    hwc = [f == HWC for f in output_formats]
    if not any(hwc):
        return kernel
    last = torch.channels_last

    def run(xs):
        return [y.contiguous(memory_format=last) if want and isinstance(y, torch.Tensor) and y.dim() == 4 else y
                for y, want in zip(kernel(xs), hwc)]
    if hasattr(kernel, "write_into"):   # it writes into a view of any layout (kiln.runtime.elision)
        run.write_into = kernel.write_into
    return run


def _is_elementwise(layer: LayerView) -> bool:
    from kiln.ops import OpKind

    opdef = lookup(layer.op_type, layer.domain)
    return opdef is not None and opdef.kind == OpKind.ELEMENTWISE
