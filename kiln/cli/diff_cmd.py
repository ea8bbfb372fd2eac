"""kiln diff A B: match two engines' layers (kiln or TensorRT), show what changed and what explains the time.
`--by onnx` compares them per ONNX node instead: the layer, precision and time share each node got in A and B."""
from __future__ import annotations

import argparse
import dataclasses

from kiln.cli.by_onnx_output import add_by_onnx_arguments, load_model_nodes, print_by_onnx, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first engine description (layer info JSON, log dump, .kiln)")
    p.add_argument("b", help="second engine description")
    p.add_argument("--profile-a", metavar="P", help="profile JSON for A")
    p.add_argument("--profile-b", metavar="Q", help="profile JSON for B")
    add_by_onnx_arguments(p)
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="print the result as JSON (to OUT when given)")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile

    a, b = load_engine_info(args.a), load_engine_info(args.b)
    profile_a, profile_b = load_profile(args.profile_a) or a.profile, load_profile(args.profile_b) or b.profile
    if args.by == "onnx":
        from kiln.inspect.by_onnx import by_onnx, to_json

        result = by_onnx(a, profile_a, b, profile_b, load_model_nodes(args.model))
        if args.json:
            write_json(to_json(result), args.json)
        else:
            print_by_onnx(result, f"{args.a} (A) vs {args.b} (B), by ONNX node")
        return 0
    if args.model:
        from kiln.errors import Error

        raise Error("--model is used with --by onnx only")
    from kiln.inspect.diff import diff

    result = diff(a, b, profile_a, profile_b)
    if args.json:
        write_json(dataclasses.asdict(result), args.json)
        return 0
    for line in result.explanation:
        console.info(line)
    return 0
