"""kiln's C kernels as a native module: the sources in csrc/, one table of libraries and signatures (catalog),
the toolchain probe (once per process, on first use, never at import), the verified cache, compile and load.

    native.library("gemm")                     # a ctypes library, signatures set; None where no C compiler is
    native.library("winograd", rendered_text)  # a template's library, after its renderer's text
    native.available()                         # whether a C compiler builds kiln's kernels here

Every tactic asks `library(...)` and treats None the same way: the layer is not offered at build time, and an
engine built elsewhere runs such layers on torch's reference kernels (kiln.runtime.prepare)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import Error
from kiln.native import cache, external
from kiln.native.catalog import LIBRARIES, LibrarySpec, bind, header_constant, translation_unit
from kiln.native.compiler import CompileError, Toolchain, candidates, compiler_version, find_compiler

log = logging.getLogger("kiln.native")

_LOCK = threading.RLock()
_LOADED: dict[tuple[str, str], ctypes.CDLL] = {}


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain | None:
    """The toolchain that builds kiln's kernels here (with the vectorized libm where it links), or None. The
    probe library is cached like any kernel, so a later process only asks the compiler for its version."""
    compiler = find_compiler()
    version = compiler_version(compiler) if compiler else None
    if compiler is None or version is None:
        log.debug("no C compiler: kiln's C kernels are unavailable")
        return None
    unit = translation_unit(LIBRARIES["probe"])
    for candidate in candidates(compiler, version):
        try:
            cache.ensure("probe", cache.cache_key("probe", unit, candidate), unit, candidate)
            return candidate
        except (CompileError, Error, OSError) as exc:   # no libmvec, no OpenMP, an unwritable cache ...
            log.debug("toolchain %s %s: %s", compiler, " ".join(candidate.libs), exc)
    log.debug("%s cannot build a shared library with OpenMP: kiln's C kernels are unavailable", compiler)
    return None


def available() -> bool:
    """Whether kiln's C kernels can be built here (probes the compiler on first call)."""
    return toolchain() is not None


def library(name: str, generated: str = "") -> ctypes.CDLL | None:
    """Kernel library `name` (catalog.LIBRARIES) built for this machine, verified and loaded, its functions'
    signatures set; None where no C compiler is. `generated`: the renderer's text for a template or generated
    library. Raises CompileError if the compiler rejects it."""
    lib = _LOADED.get((name, generated))
    if lib is not None:
        return lib
    spec = LIBRARIES[name]
    tc = toolchain_for(spec)
    if tc is None:
        return None
    with _LOCK:
        lib = _LOADED.get((name, generated))
        if lib is None:
            unit = translation_unit(spec, generated)
            path = cache.ensure(name, cache.cache_key(name, unit, tc), unit, tc)
            lib = _LOADED[(name, generated)] = bind(ctypes.CDLL(str(path)), spec)
    return lib


def toolchain_for(spec: LibrarySpec) -> Toolchain | None:
    """The toolchain plus the flags of the external library `spec` links (kiln.native.external), or None where
    there is no C compiler or that library is not installed."""
    tc = toolchain()
    extra = external.build_flags(spec.needs) if tc is not None else None
    if tc is None or extra is None:
        return None
    return tc if not spec.needs else dataclasses.replace(tc, flags=tc.flags + extra[0], libs=tc.libs + extra[1])


def buildable(name: str) -> bool:
    """Whether library `name` builds here: a C compiler, and the external library it links (if any)."""
    return toolchain_for(LIBRARIES[name]) is not None


@dataclass(frozen=True)
class LibraryState:
    """One library as `kiln kernels list` shows it."""

    name: str
    key: str
    path: Path
    built: bool
    problem: str | None   # why it would be refused (cache.NO_RECORD, cache.CHANGED ...), None when verified


def state(name: str, generated: str = "") -> LibraryState:
    """Where library `name` is cached for this toolchain and whether it is built and verified (no compile)."""
    require_toolchain()
    tc = toolchain_for(LIBRARIES[name])
    if tc is None:
        raise Error(f"kernel library '{name}' links {LIBRARIES[name].needs}, which is not installed here "
                    f"(pip install {external.ONEDNN_WHEELS})")
    unit = translation_unit(LIBRARIES[name], generated)
    key = cache.cache_key(name, unit, tc)
    path = cache.library_path(name, key)
    built = path.is_file()
    return LibraryState(name, key, path, built, cache.problem_with(path) if built else None)


def verify_cache() -> list[tuple[Path, str | None]]:
    """Every library in the cache folder with why it would be refused (None: its hash matches its record)."""
    return [(path, cache.problem_with(path)) for path in cache.cached_libraries()]


def kernel_folder() -> Path:
    """The kernel cache folder this process uses."""
    return cache.folder()


def remove_cached(library: Path) -> None:
    """Delete a cached library and its record (kiln builds it again when it needs it)."""
    cache.remove(library)


def require_toolchain() -> Toolchain:
    """The toolchain, or an Error saying how to get a C compiler."""
    tc = toolchain()
    if tc is None:
        raise Error("no C compiler that builds kiln's kernels here (cc, or $CC, with OpenMP); install gcc "
                    "(apt-get install gcc) or set CC")
    return tc


def reset() -> None:
    """Forget this process's probe, cache folder and loaded libraries (tests that hide the compiler or move
    KILN_CACHE_DIR); libraries already mapped stay mapped."""
    toolchain.cache_clear()
    external.onednn_prefix.cache_clear()
    cache.folder.cache_clear()
    with _LOCK:
        _LOADED.clear()


__all__ = ["LIBRARIES", "CompileError", "LibrarySpec", "LibraryState", "Toolchain", "available", "buildable",
           "header_constant", "kernel_folder", "library", "remove_cached", "require_toolchain", "reset", "state",
           "toolchain", "toolchain_for", "verify_cache"]
