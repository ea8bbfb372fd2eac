"""kiln lint FILE: findings (rule, layer, severity, hazard, mitigation) for a kiln or TensorRT engine description."""
from __future__ import annotations

import argparse
import dataclasses
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="layer info JSON, trtexec log dump, or .kiln engine")
    p.add_argument("--profile", metavar="P", help="trtexec --exportProfile JSON (enables time-based rules)")
    p.add_argument("--json", action="store_true", help="print the findings as a JSON list")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.inspect.lint import lint

    engine = load_engine_info(args.file)
    findings = lint(engine, load_profile(args.profile) or engine.profile)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
        return 0
    if not findings:
        console.info(f"{args.file}: no findings")
    for f in findings:
        console.info(f"[{f.severity}] {f.rule_id} {f.layer or '(engine)'}: {f.hazard} -- fix: {f.mitigation}")
    return 0
