"""kiln: an inference optimizer for ONNX models that shows its work.

    engine = kiln.build("model.onnx")        # import, optimize, choose kernels
    engine.save("model.kiln"); engine = kiln.load("model.kiln")
    outputs = engine.run({"input": x})       # numpy in, numpy out
    engine.layer_info("detailed")            # trtexec --exportLayerInfo schema
"""
from __future__ import annotations

__version__ = "0.1.0"

from kiln.errors import EngineFormatError, Error, InputError, ModelError, UnsupportedOpError  # noqa: E402


def build(model, **options):
    """Build an Engine from an ONNX path or ModelProto. Options: see `kiln.engine.builder.BuildOptions`."""
    from kiln.engine.builder import BuildOptions, build_plan
    from kiln.runtime.engine import Engine

    opts = BuildOptions(**{k: (frozenset(v) if k in ("disabled_passes", "tactic_sources") and v is not None else v)
                           for k, v in options.items()})
    return Engine(build_plan(model, opts))


def load(path):
    """Load an engine file written by `Engine.save` / `kiln build`."""
    from kiln.runtime.engine import load as _load

    return _load(path)


def __getattr__(name):
    if name == "Engine":
        from kiln.runtime.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["build", "load", "Engine", "Error", "ModelError", "UnsupportedOpError", "EngineFormatError", "InputError"]
