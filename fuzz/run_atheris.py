"""Coverage-guided fuzzing of kiln's file readers with atheris (libFuzzer), one target at a time, bounded time.

    make fuzz                                     # every target, FUZZ_SECONDS each (default 60)
    .venv/bin/python fuzz/run_atheris.py engine -max_total_time=300

Seeds are real files (a built engine, an ONNX model, the TensorRT fixtures); any exception other than a
kiln.Error is a crash, which libFuzzer reports (with the input saved as crash-*) and exits non-zero."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy  # noqa: E402,F401  (heavy dependencies first, uninstrumented)
import onnx  # noqa: E402,F401
import torch  # noqa: E402,F401

with atheris.instrument_imports(include=["kiln", "fuzz"]):
    import kiln.plan.serialize  # noqa: F401
    import kiln.frontend  # noqa: F401
    import kiln.trt.artifacts  # noqa: F401
    import kiln.trt.build_log_reader  # noqa: F401
    import kiln.runtime.engine  # noqa: F401
    from fuzz import targets

TARGETS = {"engine": (targets.target_engine, lambda: [targets.seed_engine()]),
           "onnx": (targets.target_onnx, lambda: [targets.seed_model_bytes()]),
           "trt": (targets.target_trt, lambda: [p.read_bytes()[:20000] for p in targets.TRT_FIXTURES])}


def main() -> None:
    name = sys.argv[1]
    target, seeds = TARGETS[name]
    corpus = Path(tempfile.mkdtemp(prefix=f"kiln-fuzz-{name}-"))
    for i, seed in enumerate(seeds()):
        (corpus / f"seed{i}").write_bytes(seed)

    def one(data: bytes) -> None:
        target(data)
        if name == "engine" and len(data) > 64:   # also past the checksum
            target(targets.reseal(data))

    atheris.Setup([sys.argv[0], *sys.argv[2:], str(corpus)], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
