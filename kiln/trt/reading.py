"""What every artifact reader shares: the error an unreadable input raises (the file, the problem, a hint) and JSON
loading as trtexec writes it."""
from __future__ import annotations

import json
from typing import Any, Callable

from kiln.errors import ArtifactError

HINT = ("expected trtexec --exportLayerInfo/--exportProfile/--exportTimes JSON, a trtexec log, "
        "or a .kiln engine")


def artifact_error(where: str, what: str, hint: str = HINT) -> ArtifactError:
    return ArtifactError(f"{where}: {what}; hint: {hint}")


def load_json(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text, strict=False)   # strict=False: trtexec writes names raw (control characters too)
    except json.JSONDecodeError as exc:
        raise artifact_error(where, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); the file "
                                    "may be truncated") from None
    except RecursionError:
        raise artifact_error(where, "JSON nested too deeply") from None


def as_json(data: Any, where: str) -> Any:
    """Text is parsed; anything else is taken as an already-parsed document."""
    return load_json(data, where) if isinstance(data, (str, bytes)) else data


def number(v: Any, where: str, i: int, kind: Callable[[Any], Any] = float):
    """Record #i's value `v` as a number of `kind`, or the error naming the record."""
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise artifact_error(where, f"record #{i}: '{v}' is not a number", "the file may be damaged") from None
