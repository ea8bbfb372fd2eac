"""Calibration for implicit INT8 (`--int8` without Q/DQ): read calibration batches, collect the range of each
activation with onnxruntime, turn ranges into symmetric int8 scales, and write the model as explicit Q/DQ.

Methods (threshold T, scale = T / 127, zero point 0) for the inputs of Conv, MatMul and Gemm; tensors quantized
only for the pools and residual sums after an INT8 layer keep T = max |x| (see `_layer_inputs`):
- minmax: T = max |x| over all batches.
- percentile: T = the given percentile of |x| (read from the histogram, to within one bin).
- entropy: TensorRT's KL-divergence calibrator. |x| goes into a 2048-bin histogram over [0, max|x|]; for each
  candidate i in 128..2048 the reference P is bins[:i] with everything above clipped into bin i-1, Q is bins[:i]
  merged into 128 levels and expanded back (each level's count spread over its non-empty bins); T is the upper
  edge of the i minimizing KL(P || Q). One guard TensorRT lacks: thresholds clipping over half of the values are
  not candidates (in sparse histograms P and Q then coincide trivially, KL = 0, and T collapses to the minimum).

Ranges come from two passes over the batches (max |x|, then histograms over [0, max]) so histograms are exact.
The calibration cache is JSON {"kind": "kiln-calibration-cache", "version": 1, "method", "scales"}: no pickle."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln import optional
from kiln.errors import ArtifactError, InputError, ModelError
from kiln.fileio import atomic_write_text
from kiln.ops.dtypes import raw_bfloat16

METHODS = ("minmax", "entropy", "percentile")
PURPOSE = "INT8 calibration from data (--int8 --calib DATA)"   # a .json calibration cache needs no onnxruntime
BINS, LEVELS = 2048, 128
CACHE_KIND, CACHE_VERSION = "kiln-calibration-cache", 1
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")
POOLS = ("MaxPool", "AveragePool", "GlobalAveragePool")   # quantized input only: the layer before writes INT8
MIN_THRESHOLD = 1e-8   # an all-zero tensor still gets a positive scale
MAX_CLIPPED = 0.5      # entropy: never pick a threshold that clips more than half of the values


@dataclass(frozen=True)
class TensorRange:
    """|x| of one tensor over the calibration set: its maximum and a histogram over [0, amax]."""

    amax: float
    hist: np.ndarray   # BINS counts; bin k covers [k, k+1) * amax / BINS
    count: int


@dataclass(frozen=True)
class CalibrationCache:
    method: str
    scales: dict[str, float]


# ---------------------------------------------------------------- data

def load_calibration_data(path: str | os.PathLike, input_names: Iterable[str],
                          input_ranks: dict[str, int] | None = None,
                          input_batches: dict[str, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Batches by input name: a folder of .npz files (one batch each) or one .npz whose arrays carry a leading
    batch axis, split into batches of the model's static batch size (`input_batches`, 1 where not given). With
    `input_ranks`, an array of rank+1 is a stack of whole inputs: each item along the first axis is one batch."""
    path, names = Path(path), list(input_names)
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InputError(f"{path}: no .npz files in the calibration folder")
        return [_read_npz(f, names) for f in files]
    if not path.is_file():
        raise InputError(f"{path}: no such calibration data (expected a .npz file or a folder of .npz files)")
    arrays = _read_npz(path, names)
    stacked = {k: bool(input_ranks and k in input_ranks and v.ndim == input_ranks[k] + 1) for k, v in arrays.items()}
    steps = {k: 1 if stacked[k] else max(1, (input_batches or {}).get(k, 1)) for k in arrays}
    for k, v in arrays.items():
        if v.ndim and len(v) % steps[k]:
            raise InputError(f"{path}: array '{k}' has {len(v)} rows along its first axis, and the model's input "
                             f"'{k}' takes batches of {steps[k]}: give a multiple of {steps[k]} rows, or a stack of "
                             f"whole inputs (one axis more)")
    counts = {k: len(v) // steps[k] if v.ndim else 0 for k, v in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise InputError(f"{path}: arrays need the same number of batches along their first axis; got {counts}")
    n = next(iter(counts.values()))
    return [{k: v[i] if stacked[k] else v[i * steps[k]:(i + 1) * steps[k]] for k, v in arrays.items()}
            for i in range(n)]


def _read_npz(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: raw_bfloat16(data[k]) for k in data.files}   # bfloat16 arrays come back as raw |V2
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: cannot read calibration data ({exc}); expected an .npz with one array per "
                         "input name") from None
    missing, unknown = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
    if missing or unknown:
        raise InputError(f"{path}: calibration arrays do not match the model inputs {names}: "
                         f"missing {missing}, unknown {unknown}")
    return arrays


# ---------------------------------------------------------------- ranges and scales

def collect_ranges(onnx_model: onnx.ModelProto, batches: list[dict[str, np.ndarray]],
                   tensor_names: Iterable[str]) -> dict[str, TensorRange]:
    """Histograms of |x| for each named tensor (graph inputs or node outputs) over all batches, by onnxruntime
    on a copy of the model with the tensors added as outputs."""
    names = list(dict.fromkeys(tensor_names))
    if not batches:
        raise InputError("no calibration batches")
    run = _session(onnx_model, names)
    amax = {n: 0.0 for n in names}
    for feeds in batches:
        for n, v in run(feeds).items():
            if v.size:
                amax[n] = max(amax[n], float(np.nanmax(np.abs(v))))
    hists = {n: np.zeros(BINS, np.int64) for n in names}
    counts = dict.fromkeys(names, 0)
    for feeds in batches:
        for n, v in run(feeds).items():
            hists[n] += _histogram(np.abs(v), amax[n])
            counts[n] += v.size
    return {n: TensorRange(amax[n], hists[n], counts[n]) for n in names}


def tensor_range(samples: np.ndarray) -> TensorRange:
    """The range record of a sample array (what `collect_ranges` gives for one tensor)."""
    a = np.abs(np.asarray(samples, np.float64))
    amax = float(np.nanmax(a)) if a.size else 0.0
    return TensorRange(amax, _histogram(a, amax), a.size)


def _histogram(a: np.ndarray, amax: float) -> np.ndarray:
    a = a[np.isfinite(a)]
    return np.histogram(a, BINS, (0.0, amax if amax > 0 else 1.0))[0].astype(np.int64)


def compute_scales(stats: dict[str, TensorRange | np.ndarray], method: str = "minmax",
                   percentile: float = 99.99) -> dict[str, float]:
    """Symmetric int8 scale (threshold / 127) per tensor; `stats` values may also be raw sample arrays."""
    if method not in METHODS:
        raise InputError(f"unknown calibration method '{method}'; use one of {', '.join(METHODS)}")
    if not 0 < percentile <= 100:
        raise InputError(f"percentile {percentile} is outside (0, 100]")
    out = {}
    for name, s in stats.items():
        r = s if isinstance(s, TensorRange) else tensor_range(s)
        if method == "minmax":
            t = r.amax
        elif method == "percentile":
            t = percentile_threshold(r, percentile)
        else:
            t = entropy_threshold(r.hist, r.amax)
        out[name] = max(float(t), MIN_THRESHOLD) / 127.0
    return out


def percentile_threshold(r: TensorRange, percentile: float) -> float:
    total = int(r.hist.sum())
    if total == 0 or r.amax == 0:
        return r.amax
    k = int(np.searchsorted(np.cumsum(r.hist), percentile / 100.0 * total))
    return min(k + 1, BINS) * r.amax / BINS


def entropy_threshold(hist: np.ndarray, amax: float, levels: int = LEVELS) -> float:
    """TensorRT's KL-divergence threshold for a histogram of |x| over [0, amax] (see the module docstring)."""
    hist = np.asarray(hist, np.float64)
    bins = len(hist)
    if amax == 0 or hist.sum() == 0 or bins <= levels:
        return amax
    above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0.0]])   # above[i - 1] = hist[i:].sum()
    best_i, best_kl = bins, np.inf
    for i in range(levels, bins + 1):
        if above[i - 1] > MAX_CLIPPED * hist.sum():
            continue
        p = hist[:i].copy()
        p[i - 1] += above[i - 1]
        kl = _kl(p, _quantized(hist[:i], levels))
        if kl < best_kl:
            best_i, best_kl = i, kl
    return best_i * amax / bins


def _quantized(ref: np.ndarray, levels: int) -> np.ndarray:
    """`ref` merged into `levels` bins of i // levels source bins (the last takes the rest), expanded back with
    each level's count spread evenly over its non-empty source bins."""
    i = len(ref)
    group = np.minimum(np.arange(i) // (i // levels), levels - 1)
    nonzero = ref != 0
    total = np.bincount(group, weights=ref, minlength=levels)
    filled = np.bincount(group[nonzero], minlength=levels)
    q = np.zeros(i)
    q[nonzero] = total[group[nonzero]] / filled[group[nonzero]]
    return q


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    ps, qs = p.sum(), q.sum()
    if ps == 0 or qs == 0:
        return np.inf
    p, q = p / ps, q / qs
    m = p > 0
    if np.any(q[m] == 0):
        return np.inf
    return float(np.sum(p[m] * np.log(p[m] / q[m])))


# ---------------------------------------------------------------- Q/DQ rewriting

def quantizable_activations(onnx_model: onnx.ModelProto) -> list[str]:
    """The tensors calibration needs scales for: the non-constant inputs of Conv, MatMul and Gemm, and the inputs
    of pools and of 4-D Adds of two activations (a CNN's residual sums), so the convolutions before them write
    INT8 as in a quantize_static model."""
    consts, ranks = _constants(onnx_model.graph), tensor_ranks(onnx_model)
    out = []
    for node in onnx_model.graph.node:
        out += [node.input[k] for k in _activation_inputs(node, consts, ranks)]
    return list(dict.fromkeys(out))


def _activation_inputs(node: onnx.NodeProto, consts: dict, ranks: dict[str, int]) -> list[int]:
    """Indices of `node`'s inputs that implicit INT8 quantizes (none for other ops; BERT's 3-D residual stream
    stays float)."""
    if node.domain not in ("", "ai.onnx"):
        return []
    if node.op_type in QUANTIZED_OPS:
        return [k for k, n in enumerate(node.input[:2]) if n and n not in consts]
    if node.op_type in POOLS and node.input[0] not in consts:
        return [0]
    if node.op_type == "Add" and len(node.input) == 2 and all(n not in consts and ranks.get(n) == 4
                                                                for n in node.input):
        return [0, 1]
    return []


def _layer_inputs(onnx_model: onnx.ModelProto) -> set[str]:
    """The activations a Conv, MatMul or Gemm reads: `method` picks their thresholds. The others (read only by
    pools and residual sums, quantized so the layer before writes INT8) keep their whole range: on a ResNet-18
    entropy clipping of those (the features the global pool averages, the residual stream) took the output's
    cosine to FP32 from 0.9999 to 0.985, with nothing to gain."""
    consts = _constants(onnx_model.graph)
    return {name for n in onnx_model.graph.node if n.op_type in QUANTIZED_OPS
            for name in (n.input[k] for k in _activation_inputs(n, consts, {}))}


def tensor_ranks(onnx_model: onnx.ModelProto) -> dict[str, int]:
    """Tensor ranks from ONNX shape inference (what it cannot infer is left out): 0.45 s on ResNet-50, 1.8 s on
    BERT-base, so a caller quantizing one model many times (the INT8 budget's trials) computes them once."""
    try:
        inferred = onnx.shape_inference.infer_shapes(onnx_model).graph
    except Exception:  # noqa: BLE001 - a model shape inference rejects: only Conv/MatMul/Gemm inputs are quantized
        return {}
    return {v.name: len(v.type.tensor_type.shape.dim) for v in (*inferred.input, *inferred.value_info,
                                                                *inferred.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}


def node_key(node: onnx.NodeProto) -> str:
    """How calibration names a node: its ONNX name, or its first output's name when it has none."""
    return node.name or node.output[0]


def quantizable_nodes(onnx_model: onnx.ModelProto, scales: dict[str, float]) -> list[str]:
    """The Conv, MatMul and Gemm nodes (`node_key`) that `quantize_with_qdq` quantizes with these scales, in
    graph order: the candidates an accuracy budget may keep in FP32."""
    consts = _constants(onnx_model.graph)
    return [node_key(n) for n in onnx_model.graph.node
            if n.op_type in QUANTIZED_OPS and _activations_scaled(n, consts, scales, {})]


def _activations_scaled(node: onnx.NodeProto, consts: dict, scales: dict[str, float], ranks: dict[str, int]) -> bool:
    acts = [node.input[k] for k in _activation_inputs(node, consts, ranks)]
    return bool(acts) and all(n in scales for n in acts)


def quantize_with_qdq(onnx_model: onnx.ModelProto, scales: dict[str, float], weight_per_channel: bool = True,
                      exclude: frozenset[str] = frozenset(), ranks: dict[str, int] | None = None) -> onnx.ModelProto:
    """A copy of the model with int8 Q/DQ (symmetric, zero point 0) on the activation inputs of every Conv, MatMul and
    Gemm whose activation scales are all known (and of pools and 4-D residual Adds), and int8 weights +
    DequantizeLinear (per output channel unless `weight_per_channel` is False) on their constant float weights.
    Biases and other ops stay float, and so do the nodes named in `exclude` (`node_key`): kept in FP32, no Q/DQ on
    their inputs, float weights. `ranks`: `sum_ranks(onnx_model, scales)`, when the caller quantizes the model more
    than once."""
    opset = next((o.version for o in onnx_model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise ModelError(f"Q/DQ insertion needs opset >= 13 (per-channel DequantizeLinear); the model has {opset}")
    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    g = model.graph
    rw = _Rewriter(g)
    unknown = sorted(set(exclude) - {node_key(n) for n in g.node})
    if unknown:
        raise ModelError(f"nodes to keep in FP32 {unknown} are not nodes of the model")
    ranks = sum_ranks(onnx_model, scales) if ranks is None else ranks
    scales = _max_pools_keep_scales(g, scales)
    for node in list(g.node):
        if _activations_scaled(node, rw.consts, scales, ranks) and node_key(node) not in exclude:
            for k in _activation_inputs(node, rw.consts, ranks):
                node.input[k] = rw.activation(node.input[k], scales[node.input[k]])
            for k, name in enumerate(node.input[:2] if node.op_type in QUANTIZED_OPS else ()):
                if name in rw.consts:
                    axis = _weight_axis(node, k, rw.consts[name].ndim) if weight_per_channel else None
                    node.input[k] = rw.weight(name, axis)
        rw.nodes.append(node)
    del g.node[:]
    g.node.extend(rw.nodes)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name not in rw.consts or t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return model


def sum_ranks(onnx_model: onnx.ModelProto, scales: dict[str, float]) -> dict[str, int]:
    """The tensor ranks `quantize_with_qdq` needs: only an Add of two scaled tensors is checked for rank 4, so a
    model without one (BERT's residual stream) skips shape inference."""
    sums = any(n.op_type == "Add" and len(n.input) == 2 and all(x in scales for x in n.input)
               for n in onnx_model.graph.node)
    return tensor_ranks(onnx_model) if sums else {}


def _max_pools_keep_scales(g: onnx.GraphProto, scales: dict[str, float]) -> dict[str, float]:
    """`scales` with each MaxPool's output at its input's scale (as quantize_static writes them): the maximum
    commutes with quantization at one scale, so the pool runs on INT8 values between the layers around it."""
    out = dict(scales)
    for node in g.node:   # graph order: a chain of pools passes one scale along
        if node.op_type == "MaxPool" and node.input[0] in out and node.output[0] in out:
            out[node.output[0]] = out[node.input[0]]
    return out


def _weight_axis(node: onnx.NodeProto, index: int, ndim: int) -> int | None:
    """The output-channel axis of a constant weight: Conv W[M, C, ...] -> 0, MatMul B[..., K, N] -> last,
    Gemm B -> 1 (0 with transB); anything else (a constant left operand) is quantized per tensor."""
    if node.op_type == "Conv" and index == 1:
        return 0
    if node.op_type == "MatMul" and index == 1 and ndim >= 2:
        return ndim - 1
    if node.op_type == "Gemm" and index == 1:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return None


class _Rewriter:
    """New nodes and initializers for `quantize_with_qdq`; one Q/DQ pair per tensor, shared by its consumers."""

    def __init__(self, g: onnx.GraphProto):
        self.g, self.nodes, self.done = g, [], {}
        self.consts = _constants(g)
        self.taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | \
            {i.name for i in g.input} | {n.name for n in g.node}

    def fresh(self, base: str, suffixes: tuple[str, ...]) -> str:
        name, k = base, 1
        while any(name + s in self.taken for s in suffixes):
            name, k = f"{base}_{k}", k + 1
        self.taken.update(name + s for s in suffixes)
        return name

    def weight(self, name: str, axis: int | None) -> str:
        """int8 initializer + DequantizeLinear(W_int8, scale, zero point, axis); scale = max|W| / 127 per channel."""
        if (name, axis) not in self.done:
            w = self.consts[name].astype(np.float64)
            if axis is None:
                amax = np.array(np.abs(w).max() if w.size else 0.0)
            else:
                amax = np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)
            scale = (np.maximum(amax, MIN_THRESHOLD) / 127.0).astype(np.float32)
            shaped = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
            q = np.clip(np.round(w / shaped), -127, 127).astype(np.int8)
            b = self.fresh(f"{name}_int8", ("", "_scale", "_zero_point", "_dequantized", "_DequantizeLinear"))
            self.g.initializer.extend([numpy_helper.from_array(q, b), numpy_helper.from_array(scale, f"{b}_scale"),
                                       numpy_helper.from_array(np.zeros(scale.shape, np.int8), f"{b}_zero_point")])
            self.nodes.append(helper.make_node("DequantizeLinear", [b, f"{b}_scale", f"{b}_zero_point"],
                                               [f"{b}_dequantized"], name=f"{b}_DequantizeLinear",
                                               **({} if axis is None else {"axis": axis})))
            self.done[(name, axis)] = f"{b}_dequantized"
        return self.done[(name, axis)]

    def activation(self, name: str, scale: float) -> str:
        """QuantizeLinear -> DequantizeLinear with a scalar scale and int8 zero point 0."""
        if name not in self.done:
            b = self.fresh(f"{name}_q", ("_scale", "_zero_point", "_int8", "_dequantized", "_QuantizeLinear",
                                         "_DequantizeLinear"))
            self.g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{b}_scale"),
                                       numpy_helper.from_array(np.array(0, np.int8), f"{b}_zero_point")])
            params = [f"{b}_scale", f"{b}_zero_point"]
            self.nodes.append(helper.make_node("QuantizeLinear", [name, *params], [f"{b}_int8"],
                                               name=f"{b}_QuantizeLinear"))
            self.nodes.append(helper.make_node("DequantizeLinear", [f"{b}_int8", *params], [f"{b}_dequantized"],
                                               name=f"{b}_DequantizeLinear"))
            self.done[name] = f"{b}_dequantized"
        return self.done[name]


def _constants(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """float32 initializers that are not overridable graph inputs (the weights Q/DQ can replace)."""
    inputs = {i.name for i in g.input}
    return {t.name: numpy_helper.to_array(t) for t in g.initializer
            if t.name not in inputs and t.data_type == onnx.TensorProto.FLOAT}


# ---------------------------------------------------------------- cache and the whole flow

def save_cache(path: str | os.PathLike, scales: dict[str, float], method: str) -> None:
    _check_scales(scales, str(path))
    doc = {"kind": CACHE_KIND, "version": CACHE_VERSION, "method": method,
           "scales": {k: float(v) for k, v in sorted(scales.items())}}
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def load_cache(path: str | os.PathLike) -> CalibrationCache:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read calibration cache ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{path}: not a calibration cache (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != CACHE_KIND:
        raise ArtifactError(f"{path}: not a calibration cache (expected \"kind\": \"{CACHE_KIND}\")")
    if doc.get("version") != CACHE_VERSION:
        raise ArtifactError(f"{path}: calibration cache version {doc.get('version')!r} is not supported "
                            f"(expected {CACHE_VERSION}); recalibrate")
    if not isinstance(doc.get("method"), str):
        raise ArtifactError(f"{path}: calibration cache \"method\" must be a string")
    scales = doc.get("scales")
    if not isinstance(scales, dict):
        raise ArtifactError(f"{path}: calibration cache \"scales\" must be an object of tensor -> scale")
    _check_scales(scales, str(path))
    return CalibrationCache(doc["method"], {k: float(v) for k, v in scales.items()})


def _check_scales(scales: dict, where: str) -> None:
    for k, v in scales.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) \
                or not np.isfinite(v) or v <= 0:
            raise ArtifactError(f"{where}: calibration scale for {k!r} must be a finite positive number, got {v!r}")


def calibrate(onnx_model: onnx.ModelProto, source: str | os.PathLike, method: str = "entropy",
              cache: str | os.PathLike | None = None) -> dict[str, float]:
    """Scales for `quantizable_activations`: from a cache (.json) or from calibration data (.npz / folder),
    written to `cache` when given."""
    if str(source).endswith(".json"):
        return load_cache(source).scales
    optional.require("onnxruntime", PURPOSE)   # before reading the batches: fail fast
    inits = {t.name for t in onnx_model.graph.initializer}
    inputs = [i for i in onnx_model.graph.input if i.name not in inits]
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in inputs if i.type.tensor_type.HasField("shape")}
    static = {i.name: i.type.tensor_type.shape.dim[0].dim_value for i in inputs if ranks.get(i.name)}
    batches = load_calibration_data(source, [i.name for i in inputs], ranks, static)
    stats = collect_ranges(onnx_model, batches, quantizable_activations(onnx_model))
    layer_inputs = _layer_inputs(onnx_model)
    scales = compute_scales({n: r for n, r in stats.items() if n in layer_inputs}, method)
    scales.update(compute_scales({n: r for n, r in stats.items() if n not in layer_inputs}, "minmax"))
    if cache is not None:
        save_cache(cache, scales, method)
    return scales


def _session(onnx_model: onnx.ModelProto, names: list[str]):
    ort = optional.require("onnxruntime", PURPOSE)

    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    g = model.graph
    produced = {o for n in g.node for o in n.output if o}
    graph_inputs = {i.name for i in g.input} - {t.name for t in g.initializer}
    unknown = sorted(set(names) - produced - graph_inputs)
    if unknown:
        raise ModelError(f"calibration tensors {unknown} are neither node outputs nor inputs of the model")
    present = {o.name for o in g.output}
    g.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n in produced and n not in present)
    fetch = [n for n in names if n in produced]
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ModelError(f"onnxruntime cannot load the model for calibration: {str(exc).splitlines()[0]}") from None

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = dict(zip(fetch, sess.run(fetch, feeds))) if fetch else {}
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise InputError(f"calibration batch rejected by onnxruntime: {str(exc).splitlines()[0]}") from None
        values.update({n: np.asarray(feeds[n]) for n in names if n not in produced})
        return {n: np.asarray(values[n], np.float64) for n in names}
    return run
