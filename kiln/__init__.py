"""kiln: an inference optimizer for ONNX models that shows its work.

    engine = kiln.build("model.onnx")        # import, optimize, choose kernels
    engine.save("model.kiln"); engine = kiln.load("model.kiln")
    outputs = engine.run({"input": x})       # numpy in, numpy out
    engine.layer_info("detailed")            # trtexec --exportLayerInfo schema
"""
from __future__ import annotations

from kiln.version import __version__  # noqa: E402

from kiln.errors import EngineFormatError, Error, InputError, ModelError, UnsupportedOpError  # noqa: E402


def build(model, **options):
    """Build an Engine from an ONNX path or ModelProto. Options: `kiln.builder.options.BuildOptions`' fields, or
    as the CLI spells them (kiln.builder.spellings): bf16=True, int8=True, best=True, accuracy="cos:0.999",
    tactic_sources="-openvino,-onnxruntime", calib="data.npz", shapes="input:1x3x224x224", threads=2, ..."""
    from kiln.builder.build import build_plan
    from kiln.builder.spellings import build_options
    from kiln.runtime.engine import Engine, set_threads

    opts, threads = build_options(options)
    set_threads(threads)
    return Engine(build_plan(model, opts))


def load(path, allow_other_device: bool = False):
    """Load an engine file written by `Engine.save` / `kiln build` (refused if built on another CPU model unless
    `allow_other_device`)."""
    from kiln.runtime.engine import load as _load

    return _load(path, allow_other_device)


def __getattr__(name):
    if name == "Engine":
        from kiln.runtime.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["build", "load", "Engine", "Error", "ModelError", "UnsupportedOpError", "EngineFormatError", "InputError"]
