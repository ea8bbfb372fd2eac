"""Generated code for fused pointwise layers (tactic source "codegen"): each PointWise program becomes one C
loop nest (kiln.tactics.pointwise_c), compiled by the system C compiler for this CPU (vectorized libm,
OpenMP on torch's own thread pool) and cached per source, compiler and CPU, so loading an engine again only
maps the library. Without a C compiler the source is simply unavailable."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from kiln.errors import EngineFormatError
from kiln.fileio import cache_folder
from kiln.tactics.base import ANY, HWC, LINEAR, Kernel, LayerView
from kiln.tactics.pointwise_c import HEADER, PLAIN_HEADER, expressible, generate, loop_nest

log = logging.getLogger("kiln.build")

CODEGEN_TACTIC = "codegen.pointwise_c_simd"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
MAX_INPUTS = 32
COMPILE_TIMEOUT_S = 60


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=None)
def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


@functools.lru_cache(maxsize=None)
def _toolchain() -> tuple[str, tuple[str, ...], bool] | None:
    """(compiler, link flags, vectorized libm?) that build a probe kernel here, or None."""
    cc = compiler()
    if cc is None:
        return None
    probe = "float probe(float x) { return expf(x) + tanhf(x) + erff(x) + logf(x) + log1pf(x) + expm1f(x); }\n"
    for header, libs, simd in ((HEADER, ("-lmvec", "-lm"), True), (PLAIN_HEADER, ("-lm",), False)):
        with tempfile.TemporaryDirectory(prefix="kiln-cc-") as tmp:
            if _compile(cc, header + probe, Path(tmp) / "probe.so", libs) is None:
                return cc, libs, simd
    log.debug("codegen source unavailable: %s cannot build a shared library with OpenMP", cc)
    return None


def available() -> bool:
    return _toolchain() is not None


def _compile(cc: str, source: str, target: Path, libs: tuple[str, ...]) -> str | None:
    """Compile `source` into `target` atomically; None on success, else the compiler's message."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    src = tmp + ".c"
    try:
        Path(src).write_text(source)
        done = subprocess.run([cc, *FLAGS, "-o", tmp, src, *libs], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip()[-2000:] or f"{cc} exited with {done.returncode}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        for leftover in (src, tmp):
            try:
                os.unlink(leftover)
            except OSError:
                pass


@functools.lru_cache(maxsize=None)
def kernel_folder() -> Path:
    """$KILN_CACHE_DIR/kernels (default ~/.cache/kiln/kernels); a private temp folder if that cannot be used."""
    return cache_folder("kernels") or Path(tempfile.mkdtemp(prefix="kiln-kernels-"))


_LOADED: dict[str, ctypes.CDLL] = {}


def load_library(source: str, kind: str = "pointwise") -> ctypes.CDLL:
    """The compiled `source`, from the cache when this compiler and CPU built it before."""
    cc, libs, _ = _toolchain()
    key = hashlib.sha256("\0".join([source, cc, *FLAGS, *libs, _cpu_identity()]).encode()).hexdigest()[:32]
    if key in _LOADED:
        return _LOADED[key]
    target = kernel_folder() / f"{kind}-{key}.so"
    if not target.is_file():
        error = _compile(cc, source, target, libs)
        if error is not None:
            raise RuntimeError(f"the C compiler rejected a generated {kind} kernel: {error}")
        log.debug("codegen: compiled %s", target)
    lib = _LOADED[key] = ctypes.CDLL(str(target))
    return lib


def _scalar_inputs(layer: LayerView) -> dict[int, float]:
    return {i: float(t.reshape(-1)[0]) for i, t in layer.const_inputs.items() if t.numel() == 1}


def _is_flat(layer: LayerView) -> bool:
    """Every input read element for element (no broadcast, no tensor constant): any layout works."""
    out = tuple(np.broadcast_shapes(*layer.input_shapes))
    scalars = _scalar_inputs(layer)
    return all(i in scalars or (i not in layer.const_inputs and tuple(s) == out)
               for i, s in enumerate(layer.input_shapes))


class CodegenPointWiseTactic:
    name = CODEGEN_TACTIC
    source = "codegen"

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "PointWise" or layer.domain != "kiln" or not layer.input_shapes:
            return False
        if len(layer.input_shapes) > MAX_INPUTS or any(s is None for s in layer.input_shapes):
            return False
        if any(layer.input_dynamic) or layer.output_dtypes != ("float32",):
            return False
        if any(d != "float32" for d in layer.input_dtypes):
            return False
        try:
            np.broadcast_shapes(*layer.input_shapes)
        except ValueError:
            return False
        return expressible(layer.attrs.get("program", []), len(layer.input_shapes)) and available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY if _is_flat(layer) else LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC if HWC in input_formats and _is_flat(layer) else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        if not available():   # an engine built elsewhere, loaded where no C compiler is: same program, in torch
            from kiln.tactics.reference import ReferenceTactic

            log.warning("no C compiler here for kiln's generated pointwise kernels; running them with torch's")
            return ReferenceTactic().prepare(layer)
        out_shape = tuple(np.broadcast_shapes(*layer.input_shapes))
        scalars = _scalar_inputs(layer)
        flat = _is_flat(layer)
        shapes = [out_shape if flat else s for s in layer.input_shapes]
        nest = loop_nest(out_shape, shapes)
        try:
            source = generate(layer.attrs["program"], len(shapes), nest, scalars, simd_libm=_toolchain()[2])
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise EngineFormatError(f"a PointWise program cannot be compiled ({exc}); the engine is damaged, "
                                    "rebuild it") from None
        fn = load_library(source).kiln_pointwise
        fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
        consts = {i: t.to(torch.float32).contiguous() for i, t in layer.const_inputs.items() if i not in scalars}
        read = [i for i in range(len(shapes)) if i not in scalars and i not in consts]
        base = [consts[i].data_ptr() if i in consts else None for i in range(len(shapes))]
        pointer_array = ctypes.c_void_p * len(shapes)
        last = torch.channels_last

        def run(xs):
            fmt = torch.contiguous_format
            if flat and read:   # same-shape inputs: read them all in the first one's layout
                first = xs[read[0]]
                if first.dim() == 4 and not first.is_contiguous() and first.is_contiguous(memory_format=last):
                    fmt = last
            ins = [xs[i].contiguous(memory_format=fmt) for i in read]   # no copy where already laid out so
            pointers = pointer_array(*base)   # per call: contexts on other threads share this kernel
            for i, x in zip(read, ins):
                pointers[i] = x.data_ptr()
            out = torch.empty(out_shape, dtype=torch.float32, memory_format=fmt)
            fn(pointers, out.data_ptr())
            return [out]
        run.generated_source = source
        run.constants = consts   # the kernel reads them through raw pointers: they live as long as it does
        return run
