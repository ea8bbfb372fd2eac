"""kiln diff A B: match two engines' layers (kiln or TensorRT), show what changed and what explains the time."""
from __future__ import annotations

import argparse
import dataclasses
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first engine description (layer info JSON, log dump, .kiln)")
    p.add_argument("b", help="second engine description")
    p.add_argument("--profile-a", metavar="P", help="profile JSON for A")
    p.add_argument("--profile-b", metavar="Q", help="profile JSON for B")
    p.add_argument("--json", action="store_true", help="print matched pairs and the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.inspect.diff import diff

    a, b = load_engine_info(args.a), load_engine_info(args.b)
    result = diff(a, b, load_profile(args.profile_a) or a.profile, load_profile(args.profile_b) or b.profile)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2, default=str))
        return 0
    for line in result.explanation:
        console.info(line)
    return 0
