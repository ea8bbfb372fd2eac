"""The live display of a long `kiln build` on a terminal (rich): the stage, layers lowered of all, what is being
timed and the time elapsed, redrawn in place and gone when the build ends. Shown only when stdout and stderr are
both terminals and neither --quiet nor --verbose was given (a verbose log is the record; a pipe gets none)."""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

from kiln.builder.progress import BuildProgress


def wants_live_display(quiet: bool, verbose: bool, streams=None) -> bool:
    if quiet or verbose:
        return False
    return all(getattr(s, "isatty", lambda: False)() for s in (streams or (sys.stdout, sys.stderr)))


class BuildDisplay:
    """A callable for `BuildOptions.progress` that updates one rich progress line."""

    def __init__(self, console=None):
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description:<10}"), BarColumn(bar_width=24),
                                 TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                 TextColumn("{task.fields[detail]}", markup=False), console=console, transient=True)
        self.task = self.progress.add_task("build", total=1, count="", detail="")

    def __call__(self, event: BuildProgress) -> None:
        count = f"{event.done}/{event.total} layers" if event.stage == "lowering" else ""
        self.progress.update(self.task, description=event.stage, completed=event.done, total=event.total,
                             count=count, detail=_shorten(event.detail, 70))
        self.progress.refresh()


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


@contextlib.contextmanager
def live_build_display(enabled: bool, console=None) -> Iterator[BuildDisplay | None]:
    """The display while the block runs (None when not enabled); kiln's log lines print above it."""
    if not enabled:
        yield None
        return
    display = BuildDisplay(console)
    handlers = [h for h in logging.getLogger("kiln").handlers if isinstance(h, logging.StreamHandler)]
    streams, stdout = [h.stream for h in handlers], sys.stdout
    with display.progress:
        for handler in handlers:       # the live display redirects sys.stdout; log through it, not around it
            if handler.stream is stdout:
                handler.setStream(sys.stdout)
        try:
            yield display
        finally:
            for handler, stream in zip(handlers, streams):
                handler.setStream(stream)
