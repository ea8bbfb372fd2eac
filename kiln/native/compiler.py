"""The system C compiler as kiln uses it: where it is, its version, the flags every kernel is built with (plus
sanitizers when KILN_NATIVE_SANITIZE is set), this CPU's identity, and one compile of a translation unit into a
shared library."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.native.catalog import CSRC

OPTIMIZE = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
# -Wno-psabi: on a CPU without AVX-512 (-march=native on a Zen 3) GCC notes that 64-byte vector arguments change
# the ABI; every such function is static in one translation unit, so no caller across an ABI boundary exists.
WARNINGS = ("-Wall", "-Wextra", "-Wno-psabi")
SANITIZERS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
SANITIZE_ENV = "KILN_NATIVE_SANITIZE"   # set (to anything but "" or "0"): kernels built with SANITIZERS
SIMD_LIBM = ("-DKILN_SIMD_LIBM",)      # pointwise.h declares libm's functions `omp declare simd`
COMPILE_TIMEOUT_S = 60
VERSION_TIMEOUT_S = 10


@dataclass(frozen=True)
class Toolchain:
    """Everything that decides what a compiled kernel is: compiler, its version, flags, libraries, CPU."""

    compiler: str
    version: str
    flags: tuple[str, ...]
    libs: tuple[str, ...]
    cpu: str

    @property
    def sanitized(self) -> bool:
        return SANITIZERS[0] in self.flags


class CompileError(RuntimeError):
    """The C compiler rejected a kernel (or could not run); the message carries its diagnostics."""


def find_compiler() -> str | None:
    """$CC (default cc) on PATH, else gcc; None where neither is."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def compiler_version(compiler: str) -> str | None:
    """The first line of `compiler --version` (e.g. "gcc (Debian 12.2.0-14) 12.2.0"); None if it does not run."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def sanitizing() -> bool:
    return os.environ.get(SANITIZE_ENV, "") not in ("", "0")


def candidates(compiler: str, version: str) -> list[Toolchain]:
    """The toolchains to probe, best first: with the vectorized libm (libmvec), then without."""
    extra = SANITIZERS if sanitizing() else ()
    cpu = cpu_identity()
    return [Toolchain(compiler, version, OPTIMIZE + WARNINGS + extra + SIMD_LIBM, ("-lmvec", "-lm"), cpu),
            Toolchain(compiler, version, OPTIMIZE + WARNINGS + extra, ("-lm",), cpu)]


@functools.lru_cache(maxsize=None)
def cpu_identity() -> str:
    """The CPU's model name and ISA flags (-march=native compiles for exactly these)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compile_unit(toolchain: Toolchain, unit: str, target: Path, source_name: str,
                 extra_flags: tuple[str, ...] = ()) -> str:
    """Compile the C text `unit`, saved as `source_name` in a temporary folder, into the shared library `target`
    (written in place: callers pass a temporary path). Returns the compiler's warnings ("" when none); raises
    CompileError with its diagnostics."""
    with tempfile.TemporaryDirectory(prefix=".kiln-cc-", dir=target.parent) as tmp:
        source = Path(tmp) / source_name
        source.write_text(unit)
        command = [toolchain.compiler, *toolchain.flags, *extra_flags, f"-I{CSRC}", "-o", str(target), str(source),
                   *toolchain.libs]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CompileError(f"{toolchain.compiler} took over {COMPILE_TIMEOUT_S} s") from None
        except OSError as exc:
            raise CompileError(f"{toolchain.compiler} did not run: {exc.strerror or exc}") from None
        diagnostics = (done.stderr or done.stdout).strip()
        if done.returncode != 0:
            raise CompileError(diagnostics[-2000:] or f"{toolchain.compiler} exited with {done.returncode}")
        return diagnostics
