"""OpenVINO as an optional external library: a region (ONNX sub-model) compiled for the CPU plugin."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from kiln.tactics.base import Kernel

OPENVINO_REGION_TACTIC = "openvino.region"


def available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def _inline(model: onnx.ModelProto, external: dict[str, np.ndarray]) -> bytes:
    """OpenVINO reads weights from the model itself: put the external ones back inline."""
    for i, t in enumerate(model.graph.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(external[t.name], t.name))
    return model.SerializeToString()


def region_kernel(model: onnx.ModelProto, external: dict[str, np.ndarray], input_names: list[str],
                  output_names: list[str]) -> Kernel:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(_inline(model, external)), "CPU",
                                  {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    outputs = [compiled.output(name) for name in output_names]

    def kernel(xs):
        acts = [x for x in xs if x is not None]
        result = request.infer({name: np.ascontiguousarray(x.numpy()) for name, x in zip(input_names, acts)})
        return [torch.from_numpy(np.array(result[o])) for o in outputs]   # copy: OpenVINO reuses its buffers
    return kernel
