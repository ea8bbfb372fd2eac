"""onnxruntime as an external kernel library: a layer runs as a one-layer ONNX sub-model (row-major tensors)."""
from __future__ import annotations

import numpy as np
import torch

from kiln.tactics.base import LINEAR, Kernel, LayerView
from kiln.tactics.onnx_emit import emit, supports

MIN_OPSET = 13


def available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def session(model, external: dict[str, np.ndarray], spinning: bool = False):
    """An onnxruntime session for `model`, its large weights handed over from numpy without copies."""
    import onnxruntime as ort

    so = session_options(torch.get_num_threads(), spinning)
    if external:
        so.add_external_initializers(list(external), [ort.OrtValue.ortvalue_from_numpy(a) for a in external.values()])
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def session_options(threads: int, spinning: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # kiln interleaves onnxruntime and torch kernels: spinning threads would steal the cores torch needs next
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.log_severity_level = 3
    return so


class OnnxRuntimeLayerTactic:
    name = "onnxruntime.layer"
    source = "onnxruntime"

    def supports(self, layer: LayerView) -> bool:
        if not available() or not supports(layer) or layer.op_type in ("Shuffle",):
            return False
        return all(d in ("float32", "int64", "bool", None) for d in layer.input_dtypes)

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        model, external = emit(layer, max(layer.opset, MIN_OPSET))
        sess = session(model, external)
        feeds_idx = [(i, f"x{i}") for i, s in enumerate(layer.input_shapes)
                     if s is not None and i not in layer.const_inputs]
        out_name = sess.get_outputs()[0].name
        run = sess.run

        def kernel(xs):
            feeds = {name: np.ascontiguousarray(xs[i].numpy()) for i, name in feeds_idx}
            return [torch.from_numpy(run([out_name], feeds)[0])]
        return kernel


REGION_TACTIC = "onnxruntime.region"


def region_kernel(model, external: dict[str, np.ndarray], input_names: list[str], output_names: list[str],
                  spinning: bool = False) -> Kernel:
    """Run a region (a multi-layer ONNX model) in one onnxruntime session; inputs/outputs row-major."""
    # spinning (as standalone onnxruntime does) only when the builder found no torch kernel sharing the cores
    sess = session(model, external, spinning)
    run = sess.run

    def kernel(xs):
        acts = [x for x in xs if x is not None]   # weights live inside the sub-model
        feeds = {name: np.ascontiguousarray(x.numpy()) for name, x in zip(input_names, acts)}
        return [torch.from_numpy(y) for y in run(output_names, feeds)]
    return kernel
