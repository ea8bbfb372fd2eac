"""onnxruntime as an external kernel library: a layer runs as a one-layer ONNX sub-model (row-major tensors)."""
from __future__ import annotations

import numpy as np
import torch

from kiln import optional
from kiln.tactics.base import LINEAR, Kernel, LayerView
from kiln.tactics.onnx_emit import emit, supports

MIN_OPSET = 13
PURPOSE = "the onnxruntime tactics (onnxruntime.layer, onnxruntime.region)"


def available() -> bool:
    return optional.available("onnxruntime")


def session(model, external: dict[str, np.ndarray], spinning: bool = False, profile_prefix: str | None = None):
    """An onnxruntime session for `model`, its large weights handed over from numpy without copies;
    with `profile_prefix`, onnxruntime's per-node profiler writes there."""
    ort = optional.require("onnxruntime", PURPOSE)

    so = session_options(torch.get_num_threads(), spinning)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if external:
        so.add_external_initializers(list(external), [ort.OrtValue.ortvalue_from_numpy(a) for a in external.values()])
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def session_options(threads: int, spinning: bool = False):
    ort = optional.require("onnxruntime", PURPOSE)

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
        if not available() or not supports(layer) or layer.op_type in ("Shuffle",) or len(layer.output_dtypes) != 1:
            return False   # one output per layer model (multi-output ops run in regions or on kiln's kernels)
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


class RegionKernel:
    """One onnxruntime session for a region; `profiled_run` uses a second, profiling session whose per-node
    times are mapped back to kiln's inner layers (node names are "<layer>|<n>")."""

    def __init__(self, model, external: dict[str, np.ndarray], input_names: list[str], output_names: list[str],
                 spinning: bool):
        self.model, self.external, self.spinning = model, external, spinning
        self.input_names, self.output_names = input_names, output_names
        # spinning (as standalone onnxruntime does) only when the builder found no torch kernel sharing the cores
        self.run = session(model, external, spinning).run
        self._profiling = None
        self._tmp = None
        # onnxruntime's graph rewrites rename nodes (often after their output value): map both back to layers
        self.owner = {}
        for node in model.graph.node:
            if "|" in node.name:
                layer = node.name.rsplit("|", 1)[0]
                self.owner[node.name] = layer
                self.owner.update({out: layer for out in node.output})

    def _feeds(self, xs):
        acts = [x for x in xs if x is not None]   # weights live inside the sub-model
        return {name: np.ascontiguousarray(x.numpy()) for name, x in zip(self.input_names, acts)}

    def __call__(self, xs):
        return [torch.from_numpy(y) for y in self.run(self.output_names, self._feeds(xs))]

    def profiled_run(self, xs):
        if self._profiling is None:
            import tempfile

            self._tmp = tempfile.TemporaryDirectory(prefix="kiln-profile-")
            self._profiling = session(self.model, self.external, self.spinning, f"{self._tmp.name}/region")
        return [torch.from_numpy(y) for y in self._profiling.run(self.output_names, self._feeds(xs))]

    def end_profiling(self) -> dict[str, list[float]]:
        """Per inner layer, its milliseconds in each profiled run (in the order layers first appear)."""
        import json

        if self._profiling is None:
            return {}
        path = self._profiling.end_profiling()
        with open(path) as f:
            events = json.load(f)
        self._profiling = None
        self._tmp.cleanup()
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
        per_layer: dict[str, list[float]] = {}
        for e in events:
            name = e.get("name", "")
            if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
                continue
            layer = self._owner_of(name[: -len("_kernel_time")])
            if layer is None:
                continue
            index = next((i for i, (a, b) in enumerate(runs) if a <= e["ts"] <= b), None)
            if index is None:
                continue
            times = per_layer.setdefault(layer, [0.0] * len(runs))
            times[index] += e["dur"] / 1000.0
        return per_layer


    def _owner_of(self, node_name: str) -> str | None:
        for candidate in (node_name, node_name.removesuffix("_nchwc"), node_name.split("_token_")[0]):
            if candidate in self.owner:
                return self.owner[candidate]
        return None


def region_kernel(model, external: dict[str, np.ndarray], input_names: list[str], output_names: list[str],
                  spinning: bool = False) -> Kernel:
    """Run a region (a multi-layer ONNX model) in one onnxruntime session; inputs/outputs row-major."""
    return RegionKernel(model, external, input_names, output_names, spinning)
