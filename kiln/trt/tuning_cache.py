"""TensorRT 11.1's tuning cache: what trtexec's Global Performance Tuner (`--tuneBuildRoutes=... --tuningCacheFile=F`)
writes, read into typed records, with the best build route and the time/accuracy trade-off.

The file is JSON lines (keys as trtexec's `writeTuningCacheHeader` / `writeTuningCacheIteration` in TensorRT's
samples/common/sampleUtils.cpp write them):

* line 1, the header: tuner_version, accuracy_algorithm, accuracy_parameter {atol, rtol, epsilon},
  searching_algorithm, command_line, default_build_route, tuning_expr, files, argv;
* then one line per iteration: iter, build_route, crash, error_message, accuracy_loss ({output: loss}, null when
  crashed), gpu_time (ms, null when crashed).

Accuracy losses are costs (0 is a perfect match, for every accuracy algorithm); a route is within the accuracy budget
when every output's loss is at most the header's epsilon. Every unreadable line raises `ArtifactError` naming the file
and the line."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kiln.trt.reading import artifact_error

HEADER_KEYS = ("tuner_version", "accuracy_algorithm", "accuracy_parameter", "searching_algorithm", "command_line",
               "default_build_route", "tuning_expr", "files", "argv")
ITERATION_KEYS = ("iter", "build_route", "crash", "error_message", "accuracy_loss", "gpu_time")
_HINT = ("expected trtexec's --tuningCacheFile output: a JSON header line, then one JSON line per iteration; an "
         "interrupted tuning run can leave a partial last line (delete it, or resume with trtexec --continue)")
OK, CRASHED, FAILED, OVER_BUDGET = "ok", "crashed", "failed", "over accuracy budget"


@dataclass(frozen=True)
class TuningIteration:
    iteration: int
    build_route: str                             # knob settings; "" is the default build route
    crashed: bool
    error_message: str
    accuracy_loss: dict[str, float] | None       # per output; None when not measured (crashed or failed)
    gpu_time_ms: float | None
    line: int                                    # where it is in the file

    @property
    def max_accuracy_loss(self) -> float | None:
        return max(self.accuracy_loss.values()) if self.accuracy_loss else None


@dataclass(frozen=True)
class TuningCache:
    tuner_version: str | None
    searching_algorithm: str | None
    accuracy_algorithm: str | None
    accuracy_threshold: float | None             # accuracy_parameter.epsilon: the largest loss a route may have
    atol: float | None
    rtol: float | None
    tuning_expr: str | None
    default_build_route: str | None
    command_line: str | None
    iterations: tuple[TuningIteration, ...]

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every output an accuracy loss was measured for, in first-seen order."""
        return tuple(dict.fromkeys(k for it in self.iterations for k in (it.accuracy_loss or {})))

    def status(self, it: TuningIteration) -> str:
        if it.crashed:
            return CRASHED
        if it.gpu_time_ms is None:
            return FAILED
        limit = self.accuracy_threshold
        if limit is not None and it.max_accuracy_loss is not None and it.max_accuracy_loss > limit:
            return OVER_BUDGET
        return OK

    def best(self) -> TuningIteration | None:
        """The fastest route within the accuracy budget (ties: the earlier iteration)."""
        ok = [it for it in self.iterations if self.status(it) == OK]
        return min(ok, key=lambda it: it.gpu_time_ms) if ok else None

    def trade_off(self) -> tuple[TuningIteration, ...]:
        """The timed routes no other route beats on both GPU time and (largest) accuracy loss: the Pareto front."""
        timed = [it for it in self.iterations if self.status(it) in (OK, OVER_BUDGET)]

        def loss(it: TuningIteration) -> float:
            return it.max_accuracy_loss if it.max_accuracy_loss is not None else 0.0

        return tuple(it for it in timed if not any(
            o.gpu_time_ms <= it.gpu_time_ms and loss(o) <= loss(it) and (o.gpu_time_ms, loss(o)) != (it.gpu_time_ms,
                                                                                                    loss(it))
            for o in timed))


def is_tuning_cache(text: str) -> bool:
    """Whether text's first line is a tuning-cache header (a JSON object holding "tuner_version")."""
    first = text.lstrip().split("\n", 1)[0]
    try:
        doc = json.loads(first)
    except ValueError:
        return False
    return isinstance(doc, dict) and "tuner_version" in doc


def read_tuning_cache(text: str, where: str = "<tuning cache>") -> TuningCache:
    rows = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not rows:
        raise artifact_error(where, "the file is empty", _HINT)
    header = _json_line(rows[0][1], where, rows[0][0])
    if "tuner_version" not in header:
        raise artifact_error(where, f"line {rows[0][0]}: the header has no \"tuner_version\"", _HINT)
    params = header.get("accuracy_parameter") or {}
    if not isinstance(params, dict):
        raise artifact_error(where, f"line {rows[0][0]}: \"accuracy_parameter\" is not an object", _HINT)
    return TuningCache(
        tuner_version=_text(header, "tuner_version"), searching_algorithm=_text(header, "searching_algorithm"),
        accuracy_algorithm=_text(header, "accuracy_algorithm"),
        accuracy_threshold=_number(params.get("epsilon"), where, rows[0][0], "accuracy_parameter.epsilon"),
        atol=_number(params.get("atol"), where, rows[0][0], "accuracy_parameter.atol"),
        rtol=_number(params.get("rtol"), where, rows[0][0], "accuracy_parameter.rtol"),
        tuning_expr=_text(header, "tuning_expr"), default_build_route=_text(header, "default_build_route"),
        command_line=_text(header, "command_line"),
        iterations=tuple(_iteration(_json_line(line, where, n), where, n) for n, line in rows[1:]))


def _json_line(line: str, where: str, n: int) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise artifact_error(where, f"line {n}: not valid JSON ({exc})", _HINT) from None
    if not isinstance(doc, dict):
        raise artifact_error(where, f"line {n}: a JSON {type(doc).__name__}, not an object", _HINT)
    return doc


def _iteration(d: dict[str, Any], where: str, n: int) -> TuningIteration:
    missing = [k for k in ("iter", "build_route") if k not in d]
    if missing:
        raise artifact_error(where, f"line {n}: no " + " or ".join(f"\"{k}\"" for k in missing), _HINT)
    if not isinstance(d["iter"], int) or isinstance(d["iter"], bool):
        raise artifact_error(where, f"line {n}: \"iter\" is {d['iter']!r}, not an integer", _HINT)
    if not isinstance(d["build_route"], str):
        raise artifact_error(where, f"line {n}: \"build_route\" is {d['build_route']!r}, not text", _HINT)
    loss = d.get("accuracy_loss")
    if loss is not None:
        if not isinstance(loss, dict):
            raise artifact_error(where, f"line {n}: \"accuracy_loss\" is {loss!r}, not an object of output: loss",
                                 _HINT)
        loss = {str(k): _number(v, where, n, f"accuracy_loss.{k}") for k, v in loss.items()}
    return TuningIteration(iteration=d["iter"], build_route=d["build_route"], crashed=bool(d.get("crash", False)),
                           error_message=str(d.get("error_message") or ""), accuracy_loss=loss,
                           gpu_time_ms=_number(d.get("gpu_time"), where, n, "gpu_time"), line=n)


def _number(v: Any, where: str, n: int, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise artifact_error(where, f"line {n}: \"{key}\" is {v!r}, not a number", _HINT)
    return float(v)


def _text(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    return None if v is None else str(v)
