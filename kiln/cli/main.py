"""The `kiln` command: a registry of subcommands, each its own module; kiln errors exit with code 2."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

SUBCOMMANDS = {
    "build": "kiln.cli.build",
    "run": "kiln.cli.run",
    "inspect": "kiln.cli.inspect_cmd",
    "trtexec": "kiln.cli.trtexec",
    "lint": "kiln.cli.lint_cmd",
    "diff": "kiln.cli.diff_cmd",
    "log": "kiln.cli.log_cmd",
    "draw": "kiln.cli.draw_cmd",
    "report": "kiln.cli.report_cmd",
    "compare": "kiln.cli.compare_cmd",
    "kernels": "kiln.cli.kernels_cmd",
    "debug": "kiln.cli.debug_cmd",
    "export": "kiln.cli.export_cmd",
    "serve": "kiln.cli.serve_cmd",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Build, run and explain ONNX inference engines on CPU.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0],
                            description=module.__doc__, allow_abbrev=False)
        module.add_arguments(sp)
        sp.set_defaults(module=module)
    return p


def main(argv: list[str] | None = None) -> int:
    from kiln.cli import console
    from kiln.errors import Error

    args = parser().parse_args(_join_signed_values(sys.argv[1:] if argv is None else list(argv)))
    console.setup_logging(getattr(args, "verbose", False))
    signal.signal(signal.SIGTERM, _terminate)   # unwind like Ctrl-C: temp files are removed, targets untouched
    try:
        return args.module.run(args)
    except Error as exc:
        console.error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        console.error("interrupted; no output file was changed")
        return 130


SIGNED_LIST_OPTIONS = ("--tactic-sources", "--tacticSources")


def _join_signed_values(argv: list[str]) -> list[str]:
    """`--tactic-sources -onnxruntime,+kiln`: argparse reads a value starting with '-' as an option; trtexec's
    spelling is `--tacticSources=-CUBLAS`, so kiln accepts both by joining such a pair into OPTION=VALUE."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIGNED_LIST_OPTIONS and arg[:1] in ("-", "+") and not arg.startswith("--"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
