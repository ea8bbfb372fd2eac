"""The reference tactic: any op's torch implementation from kiln.ops, valid for every layer and layout."""
from __future__ import annotations

from kiln.ops import lookup
from kiln.ops.registry import host_value
from kiln.tactics.base import ANY, LINEAR, Kernel, LayerView

# Ops whose torch implementation is layout-transparent and cheap on channel-major tensors.
LAYOUT_AGNOSTIC = {"PointWise", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat",
                   "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
                   "BatchNormalization", "Conv", "Slice", "Split"}   # torch indexes logical axes in any layout


class ReferenceTactic:
    name = "torch.reference"
    source = "torch"

    def supports(self, layer: LayerView) -> bool:
        return lookup(layer.op_type, layer.domain) is not None

    def input_formats(self, layer: LayerView) -> list[str]:
        agnostic = layer.op_type in LAYOUT_AGNOSTIC or _is_elementwise(layer)
        return [ANY if agnostic else LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        from kiln.tactics.base import HWC

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
        return run


def _is_elementwise(layer: LayerView) -> bool:
    from kiln.ops import OpKind

    opdef = lookup(layer.op_type, layer.domain)
    return opdef is not None and opdef.kind == OpKind.ELEMENTWISE
