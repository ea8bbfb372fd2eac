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
    """Build an Engine from an ONNX path or ModelProto. Options: see `kiln.builder.options.BuildOptions`; the
    precision ones may be given flat as the CLI spells them: fp16, bf16, int8, best, layer_precisions,
    precision_constraints; `tactic_sources` takes a set of names or the CLI's spec ("-openvino,-onnxruntime")."""
    from kiln.builder.build import build_plan
    from kiln.builder.options import BuildOptions
    from kiln.precision.policy import PrecisionOptions
    from kiln.runtime.engine import Engine
    from kiln.tactics.registry import parse_sources

    if isinstance(options.get("tactic_sources"), str):
        options["tactic_sources"] = parse_sources(options["tactic_sources"])
    flat = {k: options.pop(k) for k in ("fp16", "bf16", "int8", "best", "layer_precisions") if k in options}
    if "precision_constraints" in options:
        flat["constraints"] = options.pop("precision_constraints")
    if flat:
        options["precision"] = PrecisionOptions(**flat)
    opts = BuildOptions(**{k: (frozenset(v) if k in ("disabled_passes", "tactic_sources") and v is not None else v)
                           for k, v in options.items()})
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
