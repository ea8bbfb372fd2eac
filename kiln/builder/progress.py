"""Build progress as events: the stage, how much of it is done, and what is being timed, sent to a callable that
`BuildOptions.progress` names (the CLI's live display, a test's list). Lower layers never see this module: the
lowering and the autotuner call plain callables (`Lowering.on_node`, `Autotuner.on_timing`) that feed it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

STAGES = ("preprocess", "import", "passes", "precision", "lowering", "planning")


@dataclass(frozen=True)
class BuildProgress:
    stage: str              # one of STAGES, then "done"
    done: int               # units of the stage finished: layers lowered in "lowering", else 0 or 1
    total: int              # units in the stage: the graph's layers in "lowering", else 1
    detail: str = ""        # the layer being lowered or the tactic / whole plan being timed
    elapsed_s: float = 0.0  # since the build started


class ProgressReporter:
    """Turns the build's stage boundaries and the lowering's callbacks into BuildProgress events."""

    def __init__(self, callback: Callable[[BuildProgress], None] | None):
        self.callback, self.start = callback, time.perf_counter()
        self.stage, self.done, self.total = "", 0, 1

    def emit(self, detail: str = "") -> None:
        if self.callback is not None:
            self.callback(BuildProgress(self.stage, self.done, self.total, detail,
                                        round(time.perf_counter() - self.start, 3)))

    def begin(self, stage: str) -> None:
        self.stage, self.done, self.total = stage, 0, 1
        self.emit()

    def end(self) -> None:
        self.done = self.total
        self.emit()

    def node(self, done: int, total: int, name: str) -> None:
        """Lowering.on_node: `done` of `total` graph nodes lowered, `name` next."""
        if self.stage == "lowering":
            self.done, self.total = done, total
        self.emit(f"layer '{name}'")

    def timing(self, what: str) -> None:
        """Autotuner.on_timing: a tactic (or a whole plan) about to be measured."""
        self.emit(f"timing {what}")

    def finish(self) -> None:
        self.stage, self.done, self.total = "done", 1, 1
        self.emit()
