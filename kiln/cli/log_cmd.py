"""kiln log BUILD.log: what a (trtexec or kiln) --verbose build did: passes and counts, layer trajectory, tactics."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="a trtexec --verbose or kiln build --verbose log")
    p.add_argument("--json", action="store_true", help="print the parsed log as JSON")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.errors import ArtifactError
    from kiln.trt.build_log_reader import parse_build_log
    from kiln.inspect.summary import log_json

    try:
        text = Path(args.log).read_text(errors="replace")
    except OSError as exc:
        raise ArtifactError(f"{args.log}: cannot read ({exc.strerror})") from None
    parsed = parse_build_log(text, args.log)
    doc = log_json(parsed)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    console.info(f"{args.log}: {doc['tool_version'] or 'unknown tool version'}")
    for label, count in parsed.layer_trajectory:
        console.info(f"  {label}: {count} layers")
    for name, count in sorted(parsed.pass_counts.items(), key=lambda x: -x[1]):
        console.info(f"  {name}: {count}")
    console.info(f"  tactic choices: {len(parsed.tactic_choices)}, timing lines: {len(parsed.timings)}")
    concats = doc["concatenations"]
    if any(concats.values()):
        console.info(f"  concatenations eliminated: {len(concats['eliminated'])}, kept whole: {len(concats['kept'])}; "
                     f"inputs written in place: {len(concats['retargeted'])}, copied: {len(concats['copied'])}")
        for copy in concats["copied"]:
            console.info(f"    copy {copy['tensor']} -> {copy['into']}: {copy['reason']}")
    for note in parsed.notes:
        console.info(f"  note: {note}")
    return 0
