"""kiln export TARGET FILE -o DIR: write an engine or a TensorRT artifact in another tool's form (one module per
target, registered in EXPORT_TARGETS)."""
from __future__ import annotations

import argparse
import importlib

# target name -> module with add_arguments(parser) and run(args) -> exit code
EXPORT_TARGETS: dict[str, str] = {
    "triton": "kiln.cli.export_triton",
    "model-explorer": "kiln.cli.export_model_explorer",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, module_name in EXPORT_TARGETS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0], description=module.__doc__,
                            allow_abbrev=False)
        module.add_arguments(sp)
        sp.set_defaults(export_module=module)


def run(args: argparse.Namespace) -> int:
    return args.export_module.run(args)
