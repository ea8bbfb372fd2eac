"""kiln's own layer ops (domain "kiln"): Shuffle (reshape/transpose steps) and PointWise (fused programs)."""
from __future__ import annotations

import torch

from kiln.ops.registry import OPS, OpDef, OpKind

KILN_OPS: dict[str, OpDef] = {}


def shuffle(attrs, xs):
    x = xs[0]
    for step in attrs["steps"]:
        if "transpose" in step:
            x = x.permute(*step["transpose"])
        else:   # ONNX Reshape semantics: 0 copies the input's axis
            x = x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(step["reshape"])])
    return [x]


def run_program(steps, xs):
    """Evaluate a PointWise program; args are "x<i>" (layer input), "t<k>" (step k) or {"const": value}."""
    temps: list[torch.Tensor] = []
    for step in steps:
        args = []
        for a in step["args"]:
            if a is None or isinstance(a, dict):
                args.append(None if a is None else a["const"])
            elif a[0] == "x":
                args.append(xs[int(a[1:])])
            else:
                args.append(temps[int(a[1:])])
        temps.append(OPS[step["op"]].impl(step["attrs"], args)[0])
    return temps[-1]


def pointwise(attrs, xs):
    return [run_program(attrs["program"], xs)]


KILN_OPS["Shuffle"] = OpDef("Shuffle", OpKind.INJECTIVE, shuffle, (), "Shuffle")
KILN_OPS["PointWise"] = OpDef("PointWise", OpKind.ELEMENTWISE, pointwise, (), "PointWise")
