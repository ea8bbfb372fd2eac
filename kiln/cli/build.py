"""kiln build MODEL.onnx -o ENGINE.kiln: optimize an ONNX model into an engine file."""
from __future__ import annotations

import argparse

from kiln.errors import Error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("-o", "--output", required=True, help="engine file to write (.kiln)")
    p.add_argument("--verbose", action="store_true", help="log every pass, fusion and non-fusion")
    p.add_argument("--export-layer-info", metavar="F", help="write layer info JSON (trtexec --exportLayerInfo schema)")
    p.add_argument("--profiling-verbosity", default="detailed", choices=["none", "layer_names_only", "detailed"],
                   help="layer-info verbosity (default: detailed, unlike trtexec)")
    p.add_argument("--shapes", metavar="SPEC", help="input shapes, e.g. input:1x3x224x224,mask:1x128")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass by name")
    p.add_argument("--verify-each", action="store_true", help="verify the IR after every pass")


def parse_shapes(spec: str | None) -> dict[str, tuple[int, ...]]:
    """`name:1x3x224x224,other:1x16` (trtexec spelling; quotes around names allowed)."""
    shapes: dict[str, tuple[int, ...]] = {}
    if not spec:
        return shapes
    for item in spec.split(","):
        name, sep, dims = item.strip().rpartition(":")
        name = name.strip("'\"")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            raise Error(f"bad shape spec '{item}': expected name:DxDxD, e.g. input:1x3x224x224") from None
    return shapes


def build_engine(args):
    import kiln

    return kiln.build(args.model, input_shapes=parse_shapes(args.shapes),
                      disabled_passes=frozenset(args.disable_pass), verify_each=args.verify_each)


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.engine.layer_info import dumps
    from kiln.engine.serialize import atomic_write_text

    engine = build_engine(args)
    engine.save(args.output)
    mem = engine.plan.memory
    console.info(f"Engine: {len(engine.plan.layers)} layers, activation memory {mem.total_bytes} bytes "
                 f"({mem.unshared_bytes} without reuse), weights {engine.plan.weight_bytes} bytes")
    console.info(f"Saved engine to {args.output}")
    if args.export_layer_info:
        atomic_write_text(args.export_layer_info, dumps(engine.layer_info(args.profiling_verbosity)))
        console.info(f"Layer info written to {args.export_layer_info}")
    return 0
