"""OpenVINO as an optional external library: a region (ONNX sub-model) compiled for the CPU plugin."""
from __future__ import annotations

import re
import threading

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from kiln import optional
from kiln.tactics.base import Kernel

OPENVINO_REGION_TACTIC = "openvino.region"


def available() -> bool:
    return optional.available("openvino")


CACHE_MIN_BYTES = 16 << 20   # only regions of loaded engines with this much weight use the compiled-model cache


def compiled_model_cache() -> str | None:
    """Folder for OpenVINO's compiled-model cache: $KILN_CACHE_DIR/openvino (default ~/.cache/kiln/openvino);
    KILN_CACHE_DIR=off disables it. None if the folder cannot be created."""
    from kiln.fileio import cache_folder

    folder = cache_folder("openvino")
    return None if folder is None else str(folder)


def _inline(model: onnx.ModelProto, external: dict[str, np.ndarray]) -> bytes:
    """OpenVINO reads weights from the model itself: put the external ones back inline."""
    for i, t in enumerate(model.graph.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(external[t.name], t.name))
    return model.SerializeToString()


def content_key(model: onnx.ModelProto, external: dict[str, np.ndarray]) -> str:
    """Names a region by what it computes: its graph (weights stored outside) and every weight's bytes. The same
    region gets the same key at build and at every load, so a build can warm the cache its engine's loads read.
    Weights are hashed one per task on two threads (hashlib releases the GIL): half the wall time on two cores."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    def digest(name: str) -> bytes:
        return hashlib.sha256(memoryview(np.ascontiguousarray(external[name])).cast("B")).digest()

    names = sorted(external)
    h = hashlib.sha256(model.SerializeToString())
    with ThreadPoolExecutor(2) as pool:
        for name, weight_digest in zip(names, pool.map(digest, names)):
            h.update(name.encode() + b"\0" + weight_digest)
    return h.hexdigest()[:32]


def region_kernel(model: onnx.ModelProto, external: dict[str, np.ndarray], input_names: list[str],
                  output_names: list[str], cached: bool = False, precision: str = "f32") -> Kernel:
    """`cached`: compile through OpenVINO's model cache (regions of at least CACHE_MIN_BYTES of weights), keyed by
    the region's content; a later compile of the same region imports the compiled blob instead. `precision`: the
    inference precision hint, f32 (FP32 layers compute in FP32; OpenVINO's default on CPUs with AVX512-BF16/AMX is
    bf16) or bf16 (a --bf16 build). The kernel's `runtime_precisions` say what each inner layer ran in."""
    ov = optional.require("openvino", f"the {OPENVINO_REGION_TACTIC} tactic")

    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_PRECISION_HINT": precision}
    big = sum(a.nbytes for a in external.values()) >= CACHE_MIN_BYTES
    cache = compiled_model_cache() if cached and big else None
    if cache:   # OpenVINO's model cache, keyed by the region file: a later load skips parsing and compiling
        from pathlib import Path

        from kiln.fileio import atomic_write_bytes

        core.set_property({"CACHE_DIR": cache})
        source = Path(cache) / f"region-{content_key(model, external)}.onnx"
        if not source.is_file():
            atomic_write_bytes(source, [_inline(model, external)])
        compiled = core.compile_model(str(source), "CPU", config)
    else:
        compiled = core.compile_model(core.read_model(_inline(model, external)), "CPU", config)
    outputs = [compiled.output(name) for name in output_names]
    per_thread = threading.local()   # an infer request runs one inference at a time: one per thread

    def kernel(xs):
        request = getattr(per_thread, "request", None)
        if request is None:
            request = per_thread.request = compiled.create_infer_request()
        acts = [x for x in xs if x is not None]
        result = request.infer({name: np.ascontiguousarray(x.numpy()) for name, x in zip(input_names, acts)},
                               share_inputs=True)   # the arrays outlive the call: no copy into OpenVINO's tensors
        return [torch.from_numpy(np.array(result[o])) for o in outputs]   # copy: OpenVINO reuses its buffers
    kernel.runtime_precisions = lambda layer_names: runtime_precisions(compiled, layer_names)
    return kernel


_RUNTIME_PRECISION = {"bf16": "BF16", "f16": "FP16", "i8": "INT8", "u8": "INT8", "f32": "FP32"}
# the execution graph's op types that do a layer's arithmetic: where a layer's nodes became one of these, its
# precision is theirs (a convolution OpenVINO ran in f32 stays FP32 though the residual add fused into it ran u8)
_COMPUTE_TYPES = frozenset({"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul",
                            "ScaledDotProductAttention"})


def runtime_precisions(compiled, layer_names: frozenset[str]) -> dict[str, frozenset[str]]:
    """Per inner layer of a region (`layer_names`; the emitter names a layer's ONNX nodes "<layer>|<k>"), the
    precisions the ops its nodes became ran in, from OpenVINO's execution graph (`runtimePrecision`): its compute
    ops' where it has any, else all of its ops'. kiln.builder.build's with_runtime_precisions grants the lowest that
    counts, so a convolution run in bf16 reads BF16 even where a reorder stayed f32."""
    found: dict[str, dict[bool, set[str]]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "originalLayersNames" not in info or "runtimePrecision" not in info:
            continue
        op_type = info["layerType"].astype(str)
        precision = _RUNTIME_PRECISION.get(info["runtimePrecision"].astype(str))
        if op_type in ("Input", "Output", "Const", "Reorder") or precision is None:
            continue
        for layer in _emitted_layers(info["originalLayersNames"].astype(str), layer_names):
            found.setdefault(layer, {}).setdefault(op_type in _COMPUTE_TYPES, set()).add(precision)
    return {layer: frozenset(kinds.get(True) or kinds[False]) for layer, kinds in found.items()}


def _emitted_layers(original_names: str, layer_names: frozenset[str]) -> list[str]:
    """The kiln layers named in OpenVINO's comma-joined `originalLayersNames`: each emitted node is "<layer>|<k>",
    where OpenVINO may append its own suffix ("<layer>|<k>/WithoutBiases") and put names of its own between them,
    and a layer's own name may hold commas (`PWN(a, b)`), so each "|<k>" is read back to the longest known name
    ending there."""
    found = []
    for marker in re.finditer(r"\|\d+", original_names):
        before = original_names[:marker.start()]
        starts = (0, *(comma.end() for comma in re.finditer(",", before)))
        name = next((before[start:] for start in starts if before[start:] in layer_names), None)
        if name is not None:
            found.append(name)
    return found
