"""AMX kernels on any CPU with AVX-512 (BF16 / VNNI): where this CPU has AMX and Linux grants it, the real kernels
run; elsewhere gemm.c or qgemm.c is compiled once per session with -DKILN_AMX_EMULATE (amx.h's tile operations in
plain C) and stands in for kiln's library, so the AMX kernels' packing, addressing and epilogue are tested
everywhere. Likewise qgemm.c built with each of its two requantization paths (`quantize_path`)."""
from __future__ import annotations

import ctypes

import pytest

from kiln import native
from kiln.native import catalog, compiler
from kiln.tactics import gemm_amx, qgemm_amx


@pytest.fixture(scope="session")
def emulated_amx_libraries(tmp_path_factory):
    """{library name: that library built with -DKILN_AMX_EMULATE, bound as kiln binds its own}, built on demand."""
    folder, built = tmp_path_factory.mktemp("amx"), {}

    def library(name: str) -> ctypes.CDLL:
        if name not in built:
            spec = catalog.LIBRARIES[name]
            target = folder / f"{name}_amx_emulated.so"
            compiler.compile_unit(native.toolchain(), catalog.translation_unit(spec), target, spec.source,
                                  ("-DKILN_AMX_EMULATE",))
            built[name] = catalog.bind(ctypes.CDLL(str(target)), spec)
        return built[name]
    return library


@pytest.fixture(scope="session")
def built_with(tmp_path_factory):
    """`built_with(name, flags)`: kiln's library `name` compiled with extra `flags`, bound as kiln binds its own
    (built once per session and flag set)."""
    folder, built = tmp_path_factory.mktemp("variants"), {}

    def library(name: str, flags: tuple[str, ...], generated: str = "") -> ctypes.CDLL:
        if (name, flags, generated) not in built:
            spec = catalog.LIBRARIES[name]
            target = folder / f"{name}_{len(built)}.so"
            compiler.compile_unit(native.toolchain(), catalog.translation_unit(spec, generated), target,
                                  spec.source or f"{name}.c", flags)
            built[name, flags, generated] = catalog.bind(ctypes.CDLL(str(target)), spec)
        return built[name, flags, generated]
    return library


QUANTIZING_LIBRARIES = ("qgemm", "quant", "layernorm", "softmax", "pointwise")   # rounding.h's quotient: x / scale


@pytest.fixture(params=["-DKILN_QUANTIZE_DIVIDE", "-DKILN_QUANTIZE_RECIPROCAL"])
def quantize_path(request, monkeypatch, built_with) -> str:
    """kiln's C kernels that quantize (QUANTIZING_LIBRARIES) built to divide by the scale, then to take the correctly
    rounded reciprocal product, whichever this CPU's build picks: both must give the division's bytes."""
    built = native.library

    def library(name: str, generated: str = ""):
        return built_with(name, (request.param,), generated) if name in QUANTIZING_LIBRARIES else \
            built(name, generated)
    monkeypatch.setattr(native, "library", library)
    return request.param


def _stand_in(request, monkeypatch, name: str, module, usable: str) -> str:
    if getattr(module, usable)():
        return "native"
    lib = request.getfixturevalue("emulated_amx_libraries")(name)
    built = native.library
    monkeypatch.setattr(native, "library", lambda n, generated="": lib if n == name else built(n, generated))
    monkeypatch.setattr(module, usable, lambda: True)
    return "emulated"


@pytest.fixture
def amx_kernels(request, monkeypatch):
    """"native" where AMX-BF16 is usable here, else "emulated" with the emulated gemm library in kiln's place."""
    return _stand_in(request, monkeypatch, "gemm", gemm_amx, "amx_usable")


@pytest.fixture
def amx_int8_kernels(request, monkeypatch):
    """"native" where AMX-INT8 is usable here, else "emulated" with the emulated qgemm library in kiln's place."""
    return _stand_in(request, monkeypatch, "qgemm", qgemm_amx, "amx_int8_usable")
