"""PointWiseFusion: chains of elementwise ops become one PointWise layer named `PWN(a, b, c)`; SwishFusion first
turns SiLU into one activation a convolution or matrix product can absorb.

    SwishFusion:      x ─► Sigmoid ─► Mul ◄─ x          ==>   x ─► Swish   (named "Sigmoid + Mul")
    PointWiseFusion:  x ─► Exp ─► Add ─► Log            ==>   x ─► PWN(Exp, Add, Log)
Each PointWise node carries a small program: steps that read layer inputs ("x0") or earlier steps ("t1").
"""
from __future__ import annotations

from typing import Any

from kiln.ir import Graph, Node, Value
from kiln.ops import OPS
from kiln.passes.manager import PassLog
from kiln.passes.patterns import is_elementwise, replace_nodes, sole_consumer, why_not_sole_consumer
from kiln.trt.vocab import fused_layer_name, pointwise_layer_name


ABSORBS_ACTIVATION = ("Conv", "ConvTranspose", "Gemm", "MatMul", "GroupNormalization", "InstanceNormalization")


def fuse_swish(g: Graph, plog: PassLog) -> None:
    """SwishFusion: Mul(x, Sigmoid(x)) (either operand order) on a convolution's, matrix product's or group norm's
    output becomes Swish(x) (ONNX opset 24, alpha 1), which ConvReluFusion / GemmActFusion / NormActFusion then
    absorb: the SiLU YOLOv5/v8 and EfficientNet write after every convolution, diffusion U-Nets after every norm. Elsewhere SiLU stays for PointWiseFusion (`PWN(Sigmoid, Mul)`)."""
    for sig in [n for n in g.nodes if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")]:
        x, mul = sig.inputs[0], sole_consumer(g, sig)
        if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or x.producer is None:
            continue
        if x.producer.op_type not in ABSORBS_ACTIVATION or x.producer.domain not in ("", "ai.onnx"):
            continue
        plog.running(sig)
        if not (len(mul.inputs) == 2 and x in mul.inputs and sig.outputs[0] in mul.inputs):
            plog.not_fused(sig, mul, f"{mul.name} does not multiply the Sigmoid's own input")
            continue
        if len(x.users) != 2 or g.is_output(x):
            plog.not_fused(sig, mul, f"{x.producer.name}'s output '{x.name}' is also read elsewhere: its "
                                     "activation cannot be absorbed")
            continue
        origin = sig.origin + mul.origin
        plog.fusing(sig, mul)
        replace_nodes(g, [sig, mul], Node(fused_layer_name(origin), "Swish", [x], [mul.outputs[0]], {"alpha": 1.0}, "",
                                          origin))


def as_program(node: Node) -> tuple[list[dict[str, Any]], list[Value]]:
    """(steps, inputs) of a PointWise node, or a one-step program for a plain elementwise op."""
    if node.op_type == "PointWise":
        return node.attrs["program"], list(node.inputs)
    host = OPS[node.op_type].host_inputs
    args: list[Any] = []
    inputs: list[Value] = []
    for i, v in enumerate(node.inputs):
        if v is None:
            args.append(None)
        elif i in host:
            args.append({"const": v.const.tolist()})
        elif any(v is u for u in inputs):   # Mul(x, x): one input read twice
            args.append(f"x{next(j for j, u in enumerate(inputs) if u is v)}")
        else:
            args.append(f"x{len(inputs)}")
            inputs.append(v)
    return [{"op": node.op_type, "attrs": _plain_attrs(node.attrs), "args": args}], inputs


def _plain_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in attrs.items()}


def merge_programs(first: Node, second: Node) -> tuple[list[dict[str, Any]], list[Value]]:
    """Inline `first` (whose output feeds `second`) into `second`'s program."""
    steps1, ins1 = as_program(first)
    steps2, ins2 = as_program(second)
    inputs = list(ins1)
    remap: dict[str, str] = {}
    produced = first.outputs[0]
    for i, v in enumerate(ins2):
        if v is produced:
            remap[f"x{i}"] = f"t{len(steps1) - 1}"
        elif any(v is u for u in inputs):
            remap[f"x{i}"] = f"x{next(j for j, u in enumerate(inputs) if u is v)}"
        else:
            remap[f"x{i}"] = f"x{len(inputs)}"
            inputs.append(v)
    shift = len(steps1)
    merged = list(steps1)
    for step in steps2:
        args = [remap.get(a, f"t{int(a[1:]) + shift}" if isinstance(a, str) and a[0] == "t" else a)
                if isinstance(a, str) else a for a in step["args"]]
        merged.append(dict(step, args=args))
    return merged, inputs


def pwn_name(origin: tuple[str, ...]) -> str:
    return pointwise_layer_name(origin)


def fuse_pointwise(g: Graph, plog: PassLog) -> None:
    """Each elementwise node merges into its sole elementwise consumer, sweep after sweep: a node read by several
    steps of one chain (the x of GELU's `x * (1 + erf(x / sqrt 2))`, SiLU's x) has that chain as its only reader
    once those steps merged, and joins it on the next sweep. What still has several readers is logged at the end."""
    while _merge_sole_consumers(g, plog):
        pass
    for node in [n for n in g.nodes if is_elementwise(n) and _sole_reader(g, n) is None]:
        for user in dict.fromkeys(u for u in node.outputs[0].users if is_elementwise(u)):
            plog.not_fused(node, user, why_not_sole_consumer(g, node))


def _sole_reader(g: Graph, node: Node) -> Node | None:
    """The one node reading `node`'s single output (perhaps as several of its inputs), if it is no graph output."""
    out = node.outputs[0]
    readers = list(dict.fromkeys(out.users))
    return readers[0] if len(node.outputs) == 1 and len(readers) == 1 and not g.is_output(out) else None


def _merge_sole_consumers(g: Graph, plog: PassLog) -> bool:
    merged = False
    for node in list(g.nodes):
        while node in g.nodes and is_elementwise(node):
            consumer = _sole_reader(g, node)
            if consumer is None or not is_elementwise(consumer):
                break
            plog.running(node)
            steps, inputs = merge_programs(node, consumer)
            origin = node.origin + consumer.origin
            plog.fusing(node, consumer)
            node = replace_nodes(g, [node, consumer], Node(pwn_name(origin), "PointWise", inputs,
                                                           list(consumer.outputs), {"program": steps}, "kiln", origin))
            merged = True
    return merged
