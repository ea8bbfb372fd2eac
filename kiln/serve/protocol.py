"""Transport-independent records of one inference (what HTTP and gRPC decode into and encode from) and the
serving errors, each with the status it maps to (HTTP 400/404/500, gRPC INVALID_ARGUMENT/NOT_FOUND/INTERNAL)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.errors import Error, InputError


class ModelNotFoundError(Error):
    """The request names a model (or a version of it) this server does not serve."""


class InferenceFailedError(Error):
    """The engine raised while running this request (a kernel exception); other requests are unaffected."""


def http_status(exc: Exception) -> int:
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, InputError):
        return 400
    return 500


@dataclass(frozen=True)
class InferInput:
    """One input tensor of a request: its declared name, datatype and shape, and its values."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray


@dataclass(frozen=True)
class RequestedOutput:
    """An output the client asked for; `binary` is the Triton extension's per-output choice (None: default)."""

    name: str
    binary: bool | None = None


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    model_version: str
    inputs: tuple[InferInput, ...]
    outputs: tuple[RequestedOutput, ...] = ()   # empty: every output
    id: str = ""
    binary_output: bool = False                  # `parameters.binary_data_output`: default for every output


@dataclass(frozen=True)
class InferOutput:
    name: str
    datatype: str
    array: np.ndarray


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    outputs: tuple[InferOutput, ...]
    id: str = ""
    timings_us: dict[str, float] = field(default_factory=dict, compare=False)
