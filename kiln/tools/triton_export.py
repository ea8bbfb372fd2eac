"""An engine as a model of a Triton Inference Server model repository: `<name>/config.pbtxt` (Python backend,
Triton data types, dims, batching, CPU instances) and `<name>/1/model.py` (a `TritonPythonModel` that runs the
engine with kiln) beside `<name>/1/model.kiln`, written into a temp folder and renamed into place."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kiln.errors import EngineFormatError, Error
from kiln.fileio import atomic_write_bytes, atomic_write_text
from kiln.plan.model import Plan, TensorDesc
from kiln.plan.serialize import plan_from_bytes
from kiln.version import __version__

# numpy dtype name -> Triton's model-config DataType (model_config.proto); kiln engines use no other dtypes
TRITON_DATA_TYPES: dict[str, str] = {
    "bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64", "int8": "TYPE_INT8", "int16": "TYPE_INT16", "int32": "TYPE_INT32",
    "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64",
}
MODEL_VERSION = "1"
ENGINE_FILE, MODEL_FILE, CONFIG_FILE = "model.kiln", "model.py", "config.pbtxt"
MODEL_TEMPLATE = "triton_model.py.txt"   # package data beside this module: Triton's Python-backend model
DEFAULT_MAX_QUEUE_DELAY_US = 100


@dataclass(frozen=True)
class TritonTensor:
    """One input or output as config.pbtxt declares it. `dims` leave out the batch axis when the model batches;
    `reshape` is the shape the model sees when that leaves nothing (Triton needs dims non-empty: [1] -> [])."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TritonModelConfig:
    name: str
    max_batch_size: int            # 0: no batching, dims are the full shapes
    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    max_queue_delay_us: int        # dynamic batching's wait (only when max_batch_size > 0)
    instance_count: int            # KIND_CPU instances, each a Python-backend process with its own engine
    parameters: tuple[tuple[str, str], ...] = ()   # read by model.py: allow_other_device, intra_op_threads


@dataclass(frozen=True)
class BatchSupport:
    """The largest batch an engine takes on its first axis from 1 up (0 when it cannot batch), and why not."""

    max_batch_size: int
    reason: str = ""


def batch_support(plan: Plan) -> BatchSupport:
    """Triton batches along axis 0 of every input and output at once: each must be dynamic there, and some
    optimization profile must accept every batch from 1 up to the limit for all inputs together."""
    hint = "; build it with an optimization profile whose first axis varies (e.g. --min-shapes x:1x3x224x224 " \
           "--opt-shapes x:4x3x224x224 --max-shapes x:8x3x224x224)"
    if not plan.profiles:
        return BatchSupport(0, "the engine has static shapes" + hint)
    for kind, tensors in (("input", plan.inputs), ("output", plan.outputs)):
        for t in tensors:
            if 0 not in t.dynamic:
                return BatchSupport(0, f"{kind} '{t.name}' has a fixed first axis {list(t.shape_spec)}" + hint)
    best = 0
    for profile in plan.profiles:
        ranges = [profile.get(t.name) for t in plan.inputs]
        if all(r is not None and r.min[0] <= 1 for r in ranges):
            best = max(best, min(r.max[0] for r in ranges))
    if best == 0:
        return BatchSupport(0, "no optimization profile accepts a batch of 1 on the first axis of every input"
                            + hint)
    return BatchSupport(best)


def model_config(plan: Plan, name: str, max_batch_size: int | None = None, instance_count: int = 1,
                 max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US, intra_op_threads: int | None = None,
                 allow_other_device: bool = False) -> TritonModelConfig:
    """The config for `plan`. `max_batch_size` None: the engine's batch limit when it can batch, else 0."""
    check_model_name(name)
    support = batch_support(plan)
    if max_batch_size is None:
        max_batch_size = support.max_batch_size
    if max_batch_size < 0 or instance_count < 1 or max_queue_delay_us < 0 or (intra_op_threads or 1) < 1:
        raise Error(f"bad Triton settings: max batch size {max_batch_size} (>= 0), instances {instance_count} "
                    f"(>= 1), max queue delay {max_queue_delay_us} us (>= 0), threads {intra_op_threads} (>= 1)")
    if max_batch_size > 0 and support.max_batch_size == 0:
        raise Error(f"max batch size {max_batch_size}: engine '{plan.name}' cannot batch: {support.reason}; "
                    "export it with --max-batch-size 0")
    if max_batch_size > support.max_batch_size > 0:
        raise Error(f"max batch size {max_batch_size} exceeds what engine '{plan.name}' accepts: its optimization "
                    f"profile takes batches of 1 to {support.max_batch_size} on the first axis")
    batched = max_batch_size > 0
    parameters = ((("allow_other_device", "true"),) if allow_other_device else ()) + \
        ((("intra_op_threads", str(intra_op_threads)),) if intra_op_threads else ())
    return TritonModelConfig(name, max_batch_size, tuple(_tensor(t, batched) for t in plan.inputs),
                             tuple(_tensor(t, batched) for t in plan.outputs), max_queue_delay_us if batched else 0,
                             instance_count, parameters)


def _tensor(t: TensorDesc, batched: bool) -> TritonTensor:
    if t.dtype not in TRITON_DATA_TYPES:
        raise Error(f"tensor '{t.name}': data type {t.dtype} has no Triton counterpart")
    dims = t.shape_spec[1:] if batched else t.shape_spec
    if not dims:   # a scalar, or only the batch axis: Triton takes [1] and hands the model []
        return TritonTensor(t.name, TRITON_DATA_TYPES[t.dtype], (1,), ())
    return TritonTensor(t.name, TRITON_DATA_TYPES[t.dtype], tuple(dims))


def check_model_name(name: str) -> None:
    if not name or name in (".", "..") or name.startswith(".") or any(c in name for c in "/\\\0\n\""):
        raise Error(f"bad model name '{name}': it names the model's folder in the repository, so it must be "
                    "non-empty, must not start with '.' and must not hold '/', '\\', quotes or newlines")


def config_pbtxt(config: TritonModelConfig, source: str = "") -> str:
    """config.pbtxt in protobuf text format, laid out as Triton's documentation writes it."""
    lines = [f"# Written by kiln {__version__}" + (f" from {source}" if source else "")
             + ": Triton's Python backend runs the engine in 1/model.py",
             f'name: "{config.name}"', 'backend: "python"', f"max_batch_size: {config.max_batch_size}"]
    for field, tensors in (("input", config.inputs), ("output", config.outputs)):
        lines.append(f"{field} [")
        for i, t in enumerate(tensors):
            lines += ["  {", f"    name: {_quote(t.name)}", f"    data_type: {t.data_type}",
                      f"    dims: {_dims(t.dims)}"]
            if t.reshape is not None:
                lines.append(f"    reshape: {{ shape: {_dims(t.reshape)} }}")
            lines.append("  }," if i < len(tensors) - 1 else "  }")
        lines.append("]")
    if config.max_batch_size > 0:
        lines += ["dynamic_batching {", f"  max_queue_delay_microseconds: {config.max_queue_delay_us}", "}"]
    lines += ["instance_group [", "  {", "    kind: KIND_CPU", f"    count: {config.instance_count}", "  }", "]"]
    for key, value in config.parameters:
        lines.append(f'parameters: {{ key: "{key}" value: {{ string_value: {_quote(value)} }} }}')
    return "\n".join(lines) + "\n"


def _dims(dims: tuple[int, ...]) -> str:
    return f"[ {', '.join(str(d) for d in dims)} ]" if dims else "[ ]"


def _quote(text: str) -> str:
    """A protobuf text-format string literal (C escapes; bytes outside printable ASCII as octal)."""
    out = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= byte < 127:
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def model_source() -> str:
    """model.py: Triton's Python-backend model; everything it needs comes from config.pbtxt at run time."""
    return resources.files("kiln.tools").joinpath(MODEL_TEMPLATE).read_text(encoding="utf-8")


def export_triton(engine_path: str | os.PathLike, repository: str | os.PathLike, name: str | None = None,
                  force: bool = False, **settings) -> Path:
    """Write the model folder `<repository>/<name>` (name: the engine file's stem) and return its path. The
    engine file is read once: the bytes checked here are the bytes copied. `settings`: see `model_config`.
    An existing model folder is an error unless `force`; then it is replaced only once the new one is complete."""
    engine_path, repository = Path(engine_path), Path(repository)
    name = engine_path.stem if name is None else name
    check_model_name(name)
    try:
        data = engine_path.read_bytes()
    except OSError as exc:
        raise EngineFormatError(f"{engine_path}: cannot read engine file ({exc.strerror or exc})") from None
    plan = plan_from_bytes(data, str(engine_path))
    config = model_config(plan, name, **settings)
    target = repository / name
    if target.exists() and not force:
        raise Error(f"{target} already exists; give --force to replace it, or another --name")
    try:
        repository.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=repository))
    except OSError as exc:
        raise Error(f"cannot write into model repository {repository}: {exc.strerror or exc}") from None
    try:
        (staging / MODEL_VERSION).mkdir()
        atomic_write_text(staging / CONFIG_FILE, config_pbtxt(config, engine_path.name))
        atomic_write_text(staging / MODEL_VERSION / MODEL_FILE, model_source())
        atomic_write_bytes(staging / MODEL_VERSION / ENGINE_FILE, [data])
        os.chmod(staging, 0o777 & ~_umask())   # mkdtemp makes 0700 folders; Triton may run as another user
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing `target` is set aside first and removed once the rename is done
    (restored if it fails)."""
    aside = None
    try:
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, aside / target.name)
        os.replace(staging, target)
    except OSError as exc:
        if aside is not None and (aside / target.name).exists() and not target.exists():
            os.replace(aside / target.name, target)
        raise Error(f"cannot write model folder {target}: {exc.strerror or exc}") from None
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
