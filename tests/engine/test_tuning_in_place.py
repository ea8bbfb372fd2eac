"""The builder tells the autotuner which inputs a layer reads last, so a kernel that writes over a dying input
(a fused residual accumulated in place) is timed the way the plan will run it."""
from __future__ import annotations

import torch
from torch import nn

import kiln
from kiln.tactics.autotune import Autotuner
from tests.models.nets import export


class Block(nn.Module):
    """stem -> t; a(t) -> u; relu(b(u) + t): t is read by `a` and, later, as `b`'s residual."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        t = self.stem(x)
        return torch.relu(self.b(self.a(t)) + t)


def test_only_inputs_read_for_the_last_time_are_offered_for_in_place_timing(tmp_path, monkeypatch):
    seen = {}
    choose = Autotuner.choose

    def spy(self, name, view, tactics, have, runners, dying=frozenset(), *rest, **options):
        seen[name] = dying
        return choose(self, name, view, tactics, have, runners, dying, *rest, **options)
    monkeypatch.setattr(Autotuner, "choose", spy)
    path = tmp_path / "block.onnx"
    export(Block().eval(), torch.randn(1, 3, 8, 8), path)
    engine = kiln.build(str(path), tactic_sources=frozenset({"kiln", "torch"}), avg_timing=1, min_timing=1)
    by_op = {name.split(" + ")[0]: dying for name, dying in seen.items()}
    assert by_op["/a/Conv"] == frozenset()         # t is read again later, by b's residual
    b_layer = next(l for l in engine.plan.layers if l.name.startswith("/b/Conv"))
    assert "/Add" in b_layer.name and len(b_layer.args) == 4   # the residual fused into b as input 3
    assert by_op["/b/Conv"] == frozenset({0, 3})   # u and t both die at b
