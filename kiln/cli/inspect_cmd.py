"""kiln inspect ENGINE.kiln: the engine's layers, tactics, formats, memory (and --json for scripts)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", help="engine file (.kiln)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("--layer-info", metavar="VERBOSITY", choices=["none", "layer_names_only", "detailed"],
                   help="print layer info JSON (trtexec schema) instead")


def summary(engine) -> dict:
    plan = engine.plan
    return {
        "name": plan.name, "num_layers": len(plan.layers),
        "inputs": [{"name": t.name, "dims": list(t.dims), "dtype": t.dtype} for t in plan.inputs],
        "outputs": [{"name": t.name, "dims": list(t.dims), "dtype": t.dtype} for t in plan.outputs],
        "activation_memory_bytes": plan.memory.total_bytes, "activation_memory_unshared_bytes": plan.memory.unshared_bytes,
        "weights_bytes": plan.weight_bytes, "build_info": plan.build_info,
        "layers": [{"name": l.name, "layer_type": l.layer_type, "parameter_type": l.parameter_type,
                    "tactic": l.tactic_name, "precision": l.precision, "origin": list(l.origin),
                    "outputs": [{"name": t.name, "dims": list(t.dims), "format": t.format_string()} for t in l.outputs]}
                   for l in plan.layers],
    }


def run(args: argparse.Namespace) -> int:
    import kiln
    from kiln.cli import console
    from kiln.engine.layer_info import dumps

    engine = kiln.load(args.engine)
    if args.layer_info:
        print(dumps(engine.layer_info(args.layer_info)), end="")
        return 0
    if args.json:
        print(json.dumps(summary(engine), indent=2))
        return 0
    console.layer_table(engine.plan)
    mem = engine.plan.memory
    console.info(f"Activation memory: {mem.total_bytes} bytes planned ({mem.unshared_bytes} without buffer reuse)")
    console.info(f"Weights: {engine.plan.weight_bytes} bytes")
    return 0
