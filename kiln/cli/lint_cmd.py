"""kiln lint FILE: the problems of a kiln or TensorRT engine description, one per cause with the layers it
touches, the costliest first when a profile gives layer times; --all lists every finding (rule, layer, severity,
hazard, mitigation)."""
from __future__ import annotations

import argparse
import dataclasses
import json

LINT_JSON_SCHEMA = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="layer info JSON, trtexec log dump, or .kiln engine")
    p.add_argument("--profile", metavar="P", help="trtexec --exportProfile JSON (enables time-based rules and ranks "
                                                  "causes by the time at stake)")
    p.add_argument("--all", action="store_true", help="list every finding, one line each, instead of one per cause")
    p.add_argument("--json", action="store_true", help="print {schema, findings, causes} as JSON")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.inspect.causes import group_by_cause
    from kiln.inspect.lint import lint

    engine = load_engine_info(args.file)
    profile = load_profile(args.profile) or engine.profile
    findings = lint(engine, profile)
    causes = group_by_cause(engine, findings, profile)
    if args.json:
        print(json.dumps({"schema": LINT_JSON_SCHEMA, "ranked_by": "time_ms" if _timed(profile) else "severity",
                          "findings": [dataclasses.asdict(f) for f in findings],
                          "causes": [dataclasses.asdict(c) for c in causes]}, indent=2))
        return 0
    if not findings:
        console.info(f"{args.file}: no findings")
        return 0
    if args.all:
        for f in findings:
            console.info(f"[{f.severity}] {f.rule_id} {f.layer or '(engine)'}: {f.hazard} -- fix: {f.mitigation}")
        return 0
    _print_causes(args.file, findings, causes, profile)
    return 0


def _timed(profile) -> bool:
    return bool(profile and profile.records)


def _print_causes(path: str, findings, causes, profile) -> None:
    from kiln.cli import console

    order = "by time at stake" if _timed(profile) else "by severity"
    console.info(f"{path}: {len(findings)} findings from {len(causes)} causes, {order} (--all lists every finding)")
    seen: dict[str, int] = {}
    for rank, c in enumerate(causes, 1):
        stake = f", {c.time_ms:.3f} ms at stake ({c.time_percent:.1f}%)" if c.time_ms is not None and \
            c.time_percent is not None else ""
        console.info(f"#{rank} [{c.severity}] {c.cause_id}: {_count(len(c.layers), 'layer') if c.layers else 'engine-wide'}, "
                     f"{_count(c.num_findings, 'finding')}{stake}")
        console.info(f"    {c.summary}")
        if not c.summary.startswith(c.example):
            console.info(f"    e.g. {c.example}")
        console.info(f"    fix: {c.mitigation}")
        if c.layers:
            console.info(f"    layers: {'; '.join(c.layers)}")
        earlier = sorted({seen[n] for n in c.layers if n in seen})
        if earlier:
            shared = sum(n in seen for n in c.layers)
            console.info(f"    {shared} of {_count(len(c.layers), 'layer')} also under " +
                         ", ".join(f"#{r}" for r in earlier))
        for name in c.layers:
            seen.setdefault(name, rank)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
