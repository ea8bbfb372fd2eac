"""AMX kernels on any CPU with AVX512-BF16: where this CPU has AMX and Linux grants it, the real kernels run;
elsewhere gemm.c is compiled once per session with -DKILN_AMX_EMULATE (amx.h's tile operations in plain C) and
stands in for kiln's gemm library, so the AMX kernels' packing, addressing and epilogue are tested everywhere."""
from __future__ import annotations

import ctypes

import pytest

from kiln import native
from kiln.native import catalog, compiler
from kiln.tactics import gemm_amx


@pytest.fixture(scope="session")
def emulated_amx_library(tmp_path_factory):
    """gemm.c built with -DKILN_AMX_EMULATE, bound as kiln binds its own."""
    spec = catalog.LIBRARIES["gemm"]
    target = tmp_path_factory.mktemp("amx") / "gemm_amx_emulated.so"
    compiler.compile_unit(native.toolchain(), catalog.translation_unit(spec), target, "gemm.c", ("-DKILN_AMX_EMULATE",))
    return catalog.bind(ctypes.CDLL(str(target)), spec)


@pytest.fixture
def amx_kernels(request, monkeypatch):
    """"native" where AMX is usable here, else "emulated" with the emulated gemm library in kiln's place."""
    if gemm_amx.amx_usable():
        return "native"
    lib = request.getfixturevalue("emulated_amx_library")
    built = native.library
    monkeypatch.setattr(native, "library", lambda name, generated="": lib if name == "gemm" else built(name, generated))
    monkeypatch.setattr(gemm_amx, "amx_usable", lambda: True)
    return "emulated"
