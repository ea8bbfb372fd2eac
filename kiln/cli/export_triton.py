"""kiln export triton ENGINE.kiln -o REPOSITORY: write the engine as a model of a Triton Inference Server model
repository: <name>/config.pbtxt (Python backend, inputs/outputs with Triton data types, max_batch_size, dynamic
batching, KIND_CPU instances) and <name>/1/model.py (a TritonPythonModel that runs the engine with kiln) beside
<name>/1/model.kiln. Engines with a dynamic first axis (an optimization profile from batch 1) batch by default
up to the profile's maximum. Serve with: tritonserver --model-repository REPOSITORY."""
from __future__ import annotations

import argparse

from kiln.tools.triton_export import DEFAULT_MAX_QUEUE_DELAY_US


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", help="engine file (.kiln)")
    p.add_argument("-o", "--output", required=True, metavar="REPOSITORY",
                   help="model repository folder (created if missing); the model goes into REPOSITORY/NAME")
    p.add_argument("--name", help="model name and folder (default: the engine file's stem)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="Triton's max_batch_size: 0 turns batching off (default: the largest batch the engine's "
                        "profile takes on its first axis, 0 for engines that cannot batch)")
    p.add_argument("--max-queue-delay-us", type=int, default=DEFAULT_MAX_QUEUE_DELAY_US, metavar="U",
                   help="dynamic batching: how long a request may wait for others to batch with "
                        f"(max_queue_delay_microseconds; default {DEFAULT_MAX_QUEUE_DELAY_US})")
    p.add_argument("--instances", type=int, default=1, metavar="K",
                   help="model instances (instance_group KIND_CPU count), each a process with its own engine")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="intra-op threads per instance (default: torch's, i.e. every core for each instance)")
    p.add_argument("--allow-other-device", action="store_true",
                   help="let the model load the engine on a CPU other than the one it was built on")
    p.add_argument("--force", action="store_true", help="replace an existing REPOSITORY/NAME folder")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.tools.triton_export import CONFIG_FILE, export_triton, MODEL_FILE, MODEL_VERSION

    target = export_triton(args.engine, args.output, name=args.name, force=args.force,
                           max_batch_size=args.max_batch_size, instance_count=args.instances,
                           max_queue_delay_us=args.max_queue_delay_us, intra_op_threads=args.threads,
                           allow_other_device=args.allow_other_device)
    console.info(f"Triton model '{target.name}' written to {target}: {CONFIG_FILE}, {MODEL_VERSION}/{MODEL_FILE}, "
                 f"{MODEL_VERSION}/model.kiln")
    console.info(f"Serve it with: tritonserver --model-repository {target.parent}")
    return 0
