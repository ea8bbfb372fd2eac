"""Error types: every failure a user can cause is a `kiln.Error` with a message naming the culprit and a fix."""
from __future__ import annotations


class Error(Exception):
    """Base class of all errors kiln reports to users (CLI exit code 2)."""

    exit_code = 2


class ModelError(Error):
    """The ONNX model is unreadable, malformed or uses something kiln cannot build."""


class UnsupportedOpError(ModelError):
    """A node uses an operator (or an attribute value) kiln has no implementation for."""

    def __init__(self, node_name: str, op_type: str, domain: str, opset: int, detail: str = ""):
        self.node_name, self.op_type, self.domain, self.opset = node_name, op_type, domain, opset
        dom = domain or "ai.onnx"
        msg = f"unsupported operator: node '{node_name}' has op type '{op_type}' (domain '{dom}', opset {opset})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class EngineFormatError(Error):
    """An engine file is truncated, tampered with, or from an incompatible kiln version."""


class InputError(Error):
    """Inputs given at run time do not match the engine's bindings."""


class ArtifactError(Error):
    """A layer-info, profile or log file cannot be read."""


class MissingDependencyError(Error):
    """A feature needs an optional package (a kiln extra such as kiln[onnxruntime]) that cannot be imported here."""

    def __init__(self, module_name: str, message: str):
        self.module_name = module_name
        super().__init__(message)
