"""In-place kernels: a kernel may carry `into_input = (index, kernel)`, a variant that writes its output over
input `index`'s buffer (a fused residual accumulated where it lies). Whether a layer may use it is decided
once per run order (`donation`) and checked again per inference (`sole_owner`) by the plan interpreter, which
runs inference and the builder's timing alike, so the plan that is timed is the plan that runs."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.plan.model import Layer
from kiln.tactics.base import Kernel


def donation(layer: Layer, freed_here: Sequence[str], engine_io: set[str],
             kernel: Kernel) -> tuple[int, Kernel] | None:
    """(input index, in-place kernel) where the kernel can write its output into an input's buffer and that
    input dies here: its last reader, not an engine input or output, and not read twice by this layer."""
    into = getattr(kernel, "into_input", None)
    if into is None or into[0] >= len(layer.args) or layer.args[into[0]].kind != "tensor":
        return None
    name = layer.args[into[0]].name
    dies_here = name in freed_here and name not in engine_io
    read_once = sum(a.kind == "tensor" and a.name == name for a in layer.args) == 1
    return into if dies_here and read_once else None


def sole_owner(tensor: torch.Tensor, env: dict[str, torch.Tensor]) -> bool:
    """No other live tensor shares `tensor`'s buffer: not a view a reshape made, and not the caller's array
    (engine inputs stay in `env` for the whole run, so a view of one is seen here too)."""
    buffer = tensor.untyped_storage().data_ptr()
    return sum(t.untyped_storage().data_ptr() == buffer for t in env.values()) == 1
