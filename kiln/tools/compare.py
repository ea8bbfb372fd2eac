"""Accuracy of an engine against its ONNX model: outputs (and, with `layerwise`, every visible intermediate tensor)
compared with onnxruntime on the same inputs.

The engine under test stays exactly as built: nothing is rebuilt, re-planned or re-tuned. Outputs come from
`engine.run`. Intermediates come from one more inference in an execution context of the same engine (the
plan interpreter, same kernels, same input checks), observing each produced tensor whose name is an ONNX node
output and copying it to numpy as it appears. Only the onnxruntime side is altered: a COPY of the ONNX model
gets those names as extra graph outputs (ValueInfo without type or shape). Channel-major ('hwc') tensors are torch channels_last, i.e.
logically NCHW, so they compare after `.contiguous()`; other non-linear layouts, intermediates kiln holds in
another shape, and tensors inside a region (a layer with `.inner`, run as one unit) are listed as skipped.

A tensor passes when max|kiln - ort| <= atol + rtol * max|ort| (non-float tensors must match exactly)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
import torch

from kiln import optional
from kiln.errors import InputError, ModelError

REPORT_KIND, REPORT_VERSION = "kiln-compare-report", 1
PURPOSE = "kiln compare"   # its reference outputs come from onnxruntime


@dataclass(frozen=True)
class TensorComparison:
    """One tensor, kiln vs onnxruntime. Errors are NaN when shapes differ; `argmax_agreement` is None unless the
    tensor is float with a last axis > 1."""

    name: str
    layer: str            # the kiln layer that produced it
    onnx_node: str        # the ONNX node that produces it
    shape: tuple[int, ...]
    dtype: str
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float    # max|a - b| / max|b|
    cosine: float
    argmax_agreement: float | None
    passed: bool
    note: str = ""


@dataclass(frozen=True)
class SkippedTensor:
    name: str
    layer: str
    reason: str


@dataclass(frozen=True)
class CompareReport:
    model: str
    engine: str
    inputs: str
    rtol: float
    atol: float
    outputs: tuple[TensorComparison, ...]
    layerwise: bool = False
    layers: tuple[TensorComparison, ...] = ()    # plan (execution) order
    skipped: tuple[SkippedTensor, ...] = ()

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def first_divergence(self) -> TensorComparison | None:
        """The first tensor, in execution order, that exceeds the tolerance (layerwise only)."""
        return next((t for t in self.layers if not t.passed), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become null."""
        first = self.first_divergence
        return _jsonable({"kind": REPORT_KIND, "version": REPORT_VERSION, "model": self.model, "engine": self.engine,
                          "inputs": self.inputs, "rtol": self.rtol, "atol": self.atol, "passed": self.passed,
                          "outputs": [asdict(o) for o in self.outputs], "layerwise": self.layerwise,
                          "layers": [asdict(t) for t in self.layers],
                          "skipped": [asdict(s) for s in self.skipped],
                          "first_divergence": asdict(first) if first else None})


INT8_MIN_COSINE = 0.999   # default acceptance for engines with INT8 layers (issue: cosine >= 0.999)


def compare(model: str | os.PathLike | onnx.ModelProto, engine, feeds: dict[str, np.ndarray] | str | os.PathLike |
            None = None, layerwise: bool = False, rtol: float = 1e-4, atol: float = 1e-6,
            seed: int = 0, min_cosine: float | None = None) -> CompareReport:
    """Run `engine` (an Engine or .kiln path) and onnxruntime on `model` with the same inputs: `feeds` by name, an
    .npz path, or random values at the engine's opt shapes (`engine.random_inputs(seed)`)."""
    from kiln.frontend import load_model

    optional.require("onnxruntime", PURPOSE)   # before any work: the reference is what is missing
    engine_label = str(engine) if isinstance(engine, (str, os.PathLike)) else "<engine>"
    model_label = str(model) if isinstance(model, (str, os.PathLike)) else "<model>"
    proto = load_model(model)
    engine = _load_engine(engine)
    if min_cosine is None and any(l.precision == "INT8" for l in engine.plan.layers):
        min_cosine = INT8_MIN_COSINE   # INT8 engines round differently from onnxruntime's kernels
    feeds, inputs_label = _resolve_feeds(feeds, engine, seed)
    _check_model_inputs(proto, engine, model_label)
    actual = engine.run(feeds)
    producers = _producers(proto)
    recorded, skipped = record_intermediates(engine, feeds, set(producers)) if layerwise else ({}, [])
    extra = [n for n in recorded if n not in engine.output_names]
    reference = run_onnxruntime(proto, feeds, list(engine.output_names) + extra, model_label)
    makers = {t.name: layer.name for layer in engine.plan.layers for t in layer.outputs}
    outputs = tuple(compare_tensor(actual[n], reference[n], n, makers.get(n, ""), producers.get(n, ""), rtol, atol,
                                   min_cosine=min_cosine) for n in engine.output_names)
    layers = []
    for n, r in recorded.items():
        if (r.value.dtype.kind == "f") != (reference[n].dtype.kind == "f"):   # a Q/DQ moved across the op writing n
            skipped.append(SkippedTensor(n, r.layer, f"kiln holds it as {r.value.dtype}, the model as "
                                                     f"{reference[n].dtype} (a Q/DQ moved across the op writing it)"))
            continue
        t = compare_tensor(r.value, reference[n], n, r.layer, producers[n], rtol, atol, r.format, min_cosine)
        if t.note.startswith("shape") and n not in engine.output_names:   # kiln's own view of the tensor
            skipped.append(SkippedTensor(n, r.layer, f"{t.note}: kiln holds it in another shape"))
        else:
            layers.append(t)
    return CompareReport(model_label, engine_label, inputs_label, rtol, atol, outputs, layerwise, tuple(layers),
                         tuple(skipped))


@dataclass(frozen=True)
class Recorded:
    value: np.ndarray
    layer: str
    format: str


def record(engine, feeds: dict[str, np.ndarray], names: set[str]) -> dict[str, Recorded]:
    """One inference of the engine's own plan and kernels (an execution context) that keeps numpy copies of the
    tensors in `names` as they are produced (a later kernel may reuse or modify the storage)."""
    makers = {t.name: (layer.name, t.format) for layer in engine.plan.layers for t in layer.outputs}
    seen: dict[str, Recorded] = {}

    def observe(name: str, tensor: torch.Tensor) -> None:
        if name in names:
            seen[name] = Recorded(_to_numpy(tensor), *makers[name])
    engine.create_execution_context().execute(feeds, observe=observe)
    return seen


def record_intermediates(engine, feeds: dict[str, np.ndarray],
                         onnx_names: set[str]) -> tuple[dict[str, Recorded], list[SkippedTensor]]:
    """Kiln's values of the tensors named like ONNX node outputs, in execution order, and those not comparable."""
    skipped: list[SkippedTensor] = []
    wanted: set[str] = set()
    graph_inputs = set(engine.input_names)
    for layer in engine.plan.layers:
        outer = {t.name for t in layer.outputs}
        for inner in layer.inner:
            skipped += [SkippedTensor(t.name, layer.name, "inside a region (runs as one unit)")
                        for t in inner.outputs if t.name in onnx_names and t.name not in outer]
        for t in layer.outputs:
            if t.name not in onnx_names or t.name in graph_inputs:
                continue
            if t.format in ("linear", "hwc"):
                wanted.add(t.name)
            else:
                skipped.append(SkippedTensor(t.name, layer.name, f"layout '{t.format}' differs from ONNX"))
    return record(engine, feeds, wanted), skipped


def compare_tensor(actual: np.ndarray, expected: np.ndarray, name: str, layer: str, onnx_node: str,
                   rtol: float, atol: float, layout: str = "linear", min_cosine: float | None = None) -> TensorComparison:
    actual, expected = np.asarray(actual), np.asarray(expected)
    dtype = str(actual.dtype)
    if layout == "hwc" and actual.ndim == 4 and actual.shape != expected.shape \
            and actual.transpose(0, 3, 1, 2).shape == expected.shape:
        actual = actual.transpose(0, 3, 1, 2)   # an NHWC-shaped array (not kiln's channels_last): back to NCHW
    if actual.shape != expected.shape:
        nan = float("nan")
        return TensorComparison(name, layer, onnx_node, tuple(actual.shape), dtype, nan, nan, nan, nan, None, False,
                                f"shape {list(actual.shape)} vs onnxruntime {list(expected.shape)}")
    a, b = actual.astype(np.float64).reshape(-1), expected.astype(np.float64).reshape(-1)
    finite = np.isfinite(a) & np.isfinite(b)
    nonfinite_ok = bool(np.all(finite | (a == b) | (np.isnan(a) & np.isnan(b))))
    diff = np.abs(a[finite] - b[finite])
    scale = float(np.abs(b[finite]).max()) if finite.any() else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    mean_abs = float(diff.mean()) if diff.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    exact = not (np.issubdtype(expected.dtype, np.floating) or np.issubdtype(actual.dtype, np.floating))
    cosine = _cosine(a[finite], b[finite])
    close = max_abs == 0 if exact else max_abs <= atol + rtol * scale
    similar = not exact and min_cosine is not None and cosine >= min_cosine   # INT8: rounding, not a bug
    passed = nonfinite_ok and (close or similar)
    note = "" if nonfinite_ok else "NaN/Inf positions differ"
    if passed and not close:
        note = f"within cosine >= {min_cosine} (INT8 rounding), not within rtol"
    return TensorComparison(name, layer, onnx_node, tuple(actual.shape), dtype, max_abs, mean_abs, max_rel,
                            cosine, _argmax_agreement(actual, expected), passed, note)


def run_onnxruntime(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str],
                    label: str = "<model>") -> dict[str, np.ndarray]:
    """onnxruntime's values of `names` (graph outputs or node outputs) on a copy of the model."""
    ort = optional.require("onnxruntime", PURPOSE)

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        values = sess.run(names, {k: np.asarray(v) for k, v in feeds.items()})
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"{label}: onnxruntime cannot run the model: {first}") from None
    return dict(zip(names, values))


def _load_engine(engine):
    if isinstance(engine, (str, os.PathLike)):
        import kiln

        return kiln.load(engine)
    return engine


def _resolve_feeds(feeds, engine, seed: int) -> tuple[dict[str, np.ndarray], str]:
    if feeds is None:
        return engine.random_inputs(seed), f"random (seed {seed}, opt shapes)"
    label = "given"
    if isinstance(feeds, (str, os.PathLike)):
        label = str(feeds)
        try:
            with np.load(feeds, allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise InputError(f"{label}: cannot read inputs ({exc}); expected an .npz with one array per input "
                             "name") from None
    unknown, missing = sorted(set(feeds) - set(engine.input_names)), sorted(set(engine.input_names) - set(feeds))
    if unknown or missing:
        raise InputError(f"{label}: inputs do not match the engine's {engine.input_names} "
                         f"(missing {missing}, unknown {unknown})")
    out = {}
    for t in engine.plan.inputs:
        arr, want = np.asarray(feeds[t.name]), np.dtype(t.dtype)
        if arr.dtype != want and (arr.dtype.kind != want.kind or arr.dtype.kind not in "fiu"):
            raise InputError(f"{label}: input '{t.name}' has dtype {arr.dtype}; the engine expects {t.dtype}")
        out[t.name] = arr.astype(want, copy=False)
    return out, label


def _check_model_inputs(proto: onnx.ModelProto, engine, label: str) -> None:
    inits = {t.name for t in proto.graph.initializer}
    names = sorted(i.name for i in proto.graph.input if i.name not in inits)
    if names != sorted(engine.input_names):
        raise ModelError(f"{label}: model inputs {names} differ from the engine's {sorted(engine.input_names)}; "
                         "is this the model the engine was built from?")


def _producers(proto: onnx.ModelProto) -> dict[str, str]:
    """ONNX tensor name -> the name of the node producing it, in graph order."""
    out: dict[str, str] = {}
    for i, node in enumerate(proto.graph.node):
        for name in node.output:
            if name:
                out[name] = node.name or f"{node.op_type}_{i}"
    return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16,):
        t = t.float()
    return t.contiguous().numpy().copy()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(np.clip(a @ b / (na * nb), -1.0, 1.0))


def _argmax_agreement(actual: np.ndarray, expected: np.ndarray) -> float | None:
    if not np.issubdtype(expected.dtype, np.floating) or expected.ndim == 0 or expected.shape[-1] <= 1:
        return None
    a = np.nan_to_num(actual.astype(np.float64)).argmax(-1)
    b = np.nan_to_num(expected.astype(np.float64)).argmax(-1)
    return float(np.mean(a == b))


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x
