"""What a build may be told, grouped by the stage that reads it (`kiln.build(model, **options)` takes these
names flat; the precision ones may be given flat too, see `kiln.build`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kiln.planning.accuracy import AccuracyBudget
from kiln.precision.policy import PrecisionOptions
from kiln.tactics.clock import WALL_CLOCK, Clock
from kiln.tactics.costs import DEFAULT_COSTS, CostPolicy


@dataclass(frozen=True)
class BuildOptions:
    # preprocess: implicit INT8 (--int8 --calib)
    calibration: str | None = None        # calibration data (.npz / folder) or cache (.json)
    calibration_method: str = "entropy"   # entropy (TensorRT's default), minmax, percentile
    calibration_cache: str | None = None  # write the computed scales here (JSON)
    # import: shapes
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    profiles: tuple[dict[str, tuple], ...] = ()   # per profile: input -> (min, opt, max) shapes
    # passes
    disabled_passes: frozenset[str] = frozenset()
    verify_each: bool = False
    # precision
    precision: PrecisionOptions = PrecisionOptions()
    accuracy: str | None = None     # budget for reduced precisions, e.g. "cos:0.999" (default with --bf16/--best);
    atol: float = 1e-5              # "off" checks nothing. atol/rtol: the l0 metric's element tolerance
    rtol: float = 1e-3
    # lowering: tactics and their timing
    tactic_sources: frozenset[str] | None = None
    autotune: bool = True
    timing_cache: str | None = None
    deterministic: bool = False     # only recorded timings from the cache; never measure
    avg_timing: int = 8
    min_timing: int = 3
    clock: Clock = WALL_CLOCK       # what every timing reads (tests give a FakeClock)
    # planning: regions and the plan race
    regions: bool = True            # let onnxruntime/OpenVINO run whole segments where that is faster
    costs: CostPolicy = DEFAULT_COSTS
    # all stages: progress events (kiln.builder.progress.BuildProgress), e.g. the CLI's live display
    progress: Callable | None = None

    def __post_init__(self):
        if self.accuracy not in (None, "off"):
            AccuracyBudget.parse(self.accuracy, self.atol, self.rtol)   # a bad budget fails before any work
