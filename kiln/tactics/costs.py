"""The cost policy: every margin and switch cost the build's choices use, in one place, each with the
measurement behind it. Tactic choice (autotune), region planning (regions) and the whole-plan race (race) read it
from the build options; tests replace it instead of patching module constants."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType


@dataclass(frozen=True)
class CostPolicy:
    """Margins (fractions) a candidate must win by, and costs (ms) added to a candidate's measured time."""

    preference_margin: float = field(default=0.05, metadata={"reason": (
        "a tactic listed later in the registry (less fused, generic or external) must be this much faster than an "
        "earlier one: one layer timed alone with hot caches flatters kernels that make extra passes over memory")})
    handover_ms: MappingProxyType = field(default_factory=lambda: MappingProxyType({"onnxruntime": 0.1,
                                                                                    "openvino": 0.1}),
                                          metadata={"reason": (
        "an external library's single layer pays the hand-over between thread pools (its workers wake, torch's "
        "spin down): a 2048x1000 FC ran 0.13 ms alone and 0.54 ms inside ResNet-50 through onnxruntime, against "
        "~0.3 ms for torch's kernel in the same place (2 cores)")})
    pool_switch_ms: float = field(default=1.0, metadata={"reason": (
        "charged per switch between kiln's and onnxruntime's segments: the pool that just finished keeps spinning "
        "while the other starts (ResNet-50 with 3 switches: 54-57 ms against 47 ms for one region, 2 cores)")})
    mix_margin: float = field(default=0.05, metadata={"reason": (
        "a mixed kiln/onnxruntime segment plan must beat one whole onnxruntime region by this much in the segment "
        "cost model: one region is predictable parity")})
    plan_margin: float = field(default=0.03, metadata={"reason": (
        "a mixed plan must beat one whole onnxruntime region by this much when whole plans are timed: torch and "
        "onnxruntime handing over cores make a mix's timing less trustworthy")})
    own_plan_margin: float = field(default=0.01, metadata={"reason": (
        "an external library's whole-graph region must beat kiln's own plan by this much: within it the two tie "
        "under timing noise, and kiln's plan is the one whose layers can be inspected, profiled and fused. At 3% "
        "an INT8 ResNet-50 build kept kiln's plan 1.9% behind OpenVINO's region in the race, and 5.8% behind in "
        "the benchmark")})
    prune_ratio: float = field(default=1.15, metadata={"reason": (
        "a whole plan this much slower than the best in its fastest of the first two timing rounds is not timed "
        "further")})

    def explain(self) -> list[tuple[str, object, str]]:
        """(name, value, reason) for every cost, for logs and docs."""
        return [(f.name, getattr(self, f.name), f.metadata["reason"]) for f in fields(self)]


DEFAULT_COSTS = CostPolicy()
