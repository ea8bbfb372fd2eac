"""BatchNormalization folded into the convolution before it, on the ONNX model, ahead of implicit INT8
calibration (--int8 --calib): Q/DQ are then written around the folded convolution, as TensorRT calibrates after
its fusions. Written between a convolution and its BatchNormalization, they would leave the normalization outside
the INT8 layer: an INT8 convolution writing FP32, then a float BatchNormalization and ReLU."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

FOLDED_KEY = "kiln.folded_nodes"   # a folded Conv's metadata: the BatchNormalization node it took in (for origins)


def fold_batch_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` where every inference-mode BatchNormalization whose input is a Conv output read by nothing
    else (not a graph output, constant weights and statistics) is folded into that Conv's weights and bias; the
    Conv takes over the BatchNormalization's output name."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inputs = {i.name for i in g.input}
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer if t.name not in inputs}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in g.output}
    folded = []
    for bn in list(g.node):
        conv = producer.get(bn.input[0]) if bn.op_type == "BatchNormalization" and bn.domain in ("", "ai.onnx") \
            else None
        if conv is None or not _foldable(conv, bn, consts, readers, outputs):
            continue
        weight, bias = _folded(conv, bn, consts)
        base = conv.name or conv.output[0]
        names = (f"{base}_bn_folded_weight", f"{base}_bn_folded_bias")
        g.initializer.extend([numpy_helper.from_array(weight, names[0]), numpy_helper.from_array(bias, names[1])])
        del conv.input[1:]
        conv.input.extend(names)
        conv.output[0] = bn.output[0]
        conv.metadata_props.add(key=FOLDED_KEY, value=bn.name or bn.output[0])
        folded.append(bn)
    for bn in folded:
        g.node.remove(bn)
    used = {name for n in g.node for name in n.input} | outputs
    kept = [t for t in g.initializer if t.name in used or t.name in inputs]
    del g.initializer[:]
    g.initializer.extend(kept)
    return out


def _foldable(conv: onnx.NodeProto, bn: onnx.NodeProto, consts: dict, readers: dict, outputs: set) -> bool:
    training = next((a.i for a in bn.attribute if a.name == "training_mode"), 0)
    return (conv.op_type == "Conv" and conv.domain in ("", "ai.onnx") and len(bn.input) == 5 and not training
            and all(o == "" for o in bn.output[1:]) and readers.get(conv.output[0]) == 1
            and conv.output[0] not in outputs and conv.input[1] in consts and consts[conv.input[1]].dtype == np.float32
            and (len(conv.input) < 3 or conv.input[2] == "" or conv.input[2] in consts)
            and all(name in consts for name in bn.input[1:]))


def _folded(conv: onnx.NodeProto, bn: onnx.NodeProto, consts: dict) -> tuple[np.ndarray, np.ndarray]:
    """(W * s per output channel, (b - mean) * s + beta), s = gamma / sqrt(var + epsilon), computed in double."""
    eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    gamma, beta, mean, var = (consts[name].astype(np.float64) for name in bn.input[1:])
    weight = consts[conv.input[1]].astype(np.float64)
    bias = consts[conv.input[2]].astype(np.float64) if len(conv.input) > 2 and conv.input[2] else \
        np.zeros(weight.shape[0])
    s = gamma / np.sqrt(var + eps)
    return ((weight * s.reshape((-1,) + (1,) * (weight.ndim - 1))).astype(np.float32),
            ((bias - mean) * s + beta).astype(np.float32))
