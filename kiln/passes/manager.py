"""Pass manager: runs named passes in order, logs them the way trtexec --verbose does, counts layers."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from kiln.ir import Graph, Node
from kiln.trt import build_log as log_lines

log = logging.getLogger("kiln.build")


class PassLog:
    """What a pass reports: the verbose lines trtexec prints, plus reasons for fusions that did not fire."""

    def __init__(self, pass_name: str):
        self.pass_name = pass_name
        self.matches = 0
        self.rejections = 0

    def running(self, node: Node | str) -> None:
        log.debug(log_lines.running(self.pass_name, _name(node)))

    def fusing(self, a: Node | str, b: Node | str) -> None:
        self.matches += 1
        log.debug(log_lines.fusing(self.pass_name, _name(a), _name(b)))

    def removing(self, node: Node | str) -> None:
        self.matches += 1
        log.debug(log_lines.removing(_name(node)))

    def lowering(self, node: Node, into: str) -> None:
        """A node rewritten as other ops (a match, as a fusion is)."""
        self.matches += 1
        log.debug(log_lines.pass_note(self.pass_name, f"Lowering {node.name} to {into}"))

    def moving(self, node: Node, above: Node) -> None:
        """`node` moved above `above` so that a fusion can follow (a match)."""
        self.matches += 1
        log.debug(log_lines.pass_note(self.pass_name, f"Moving {node.name} above {above.name}"))

    def note(self, message: str) -> None:
        log.debug(log_lines.pass_note(self.pass_name, message))

    def not_fused(self, a: Node | str, b: Node | str, reason: str) -> None:
        """kiln's addition: one line per candidate that did not fuse, naming the unmet condition."""
        self.rejections += 1
        log.debug(log_lines.not_fusing(self.pass_name, _name(a), _name(b), reason))


def _name(x: Node | str) -> str:
    return x if isinstance(x, str) else x.name


@dataclass(frozen=True)
class Pass:
    """A named graph rewrite. `run` returns nothing; it reports matches through the PassLog."""

    name: str
    run: Callable[[Graph, PassLog], None]
    milestone: str | None = None   # "After <milestone>: N layers" is logged after this pass


@dataclass(frozen=True)
class PassStat:
    name: str
    matches: int
    rejections: int
    layers_before: int
    layers_after: int
    time_ms: float


def run_passes(g: Graph, passes: list[Pass], disabled: frozenset[str] = frozenset(),
               verify_each: bool = False) -> list[PassStat]:
    start = time.perf_counter()
    log.debug(log_lines.APPLYING_OPTIMIZATIONS)
    log.debug(log_lines.original_layers(len(g.nodes)))
    stats = []
    for p in passes:
        if p.name in disabled:
            log.debug(log_lines.skipping_disabled(p.name))
            continue
        before, t0 = len(g.nodes), time.perf_counter()
        plog = PassLog(p.name)
        p.run(g, plog)
        g.prune_values()
        if verify_each:
            g.verify()
        stats.append(PassStat(p.name, plog.matches, plog.rejections, before, len(g.nodes),
                              (time.perf_counter() - t0) * 1e3))
        if p.milestone:
            log.debug(log_lines.after_layers(p.milestone, len(g.nodes)))
    distinct_layer_names(g)
    log.debug(log_lines.optimization_completed(time.perf_counter() - start))
    return stats


def distinct_layer_names(g: Graph) -> None:
    """Layers named alike (parts of one unfolded contrib node fused into different layers, both named after it)
    get their op type appended, then a count where that still repeats; each origin is listed once."""
    by_name: dict[str, list] = {}
    for node in g.nodes:
        node.origin = tuple(dict.fromkeys(node.origin))
        by_name.setdefault(node.name, []).append(node)
    taken = set(by_name)
    for name, nodes in by_name.items():
        if len(nodes) < 2:
            continue
        for node in nodes:
            candidate, count = f"{name} [{node.op_type}]", 2
            while candidate in taken:
                candidate, count = f"{name} [{node.op_type} {count}]", count + 1
            node.name = candidate
            taken.add(candidate)
