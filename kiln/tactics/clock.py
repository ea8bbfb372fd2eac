"""The one clock every build-time measurement reads (tactic, segment and whole-plan timing): the wall clock in
production; in tests a `FakeClock` whose time moves only when a fake kernel says it ran, so timing tests need no
sleeps and cannot be disturbed by a loaded machine."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> float:
        """Monotonic time in milliseconds."""
        ...


class WallClock:
    """time.perf_counter, in milliseconds."""

    def now_ms(self) -> float:
        return time.perf_counter() * 1e3


class FakeClock:
    """A clock that stands still until `advance(ms)`: a fake kernel advances it by the time it pretends to take."""

    def __init__(self) -> None:
        self.elapsed_ms = 0.0
        self.reads = 0

    def now_ms(self) -> float:
        self.reads += 1
        return self.elapsed_ms

    def advance(self, ms: float) -> None:
        self.elapsed_ms += ms


WALL_CLOCK = WallClock()


def elapsed_ms(clock: Clock, fn, runs: int = 1) -> float:
    """Average milliseconds of one call of `fn` over `runs` back-to-back calls."""
    start = clock.now_ms()
    for _ in range(runs):
        fn()
    return (clock.now_ms() - start) / runs
