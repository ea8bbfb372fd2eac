"""The CPU's instruction-set extensions that decide which kernels can run here, read once per process from
/proc/cpuinfo. Builds record them (engine build info and the timing cache's device key); a kernel that needs one
the loading CPU lacks runs its fallback, with one warning."""
from __future__ import annotations

import functools
from pathlib import Path

# The extensions that change kiln's or its peers' kernels: AVX2/AVX-512 FP32 paths, BF16/FP16 arithmetic, VNNI
# (INT8 dot products), AMX tiles (BF16/INT8 matrix units).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
BF16_ISA = ("avx512_bf16", "amx_bf16")   # native BF16 arithmetic: either one
FP16_ISA = ("avx512_fp16",)
CPUINFO = Path("/proc/cpuinfo")


@functools.lru_cache(maxsize=None)
def cpu_isa() -> frozenset[str]:
    """The ISA_FLAGS this CPU has (empty where /proc/cpuinfo cannot be read). Call it through the module
    (`hardware.cpu_isa()`), so tests can stand in another CPU."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split()) & frozenset(ISA_FLAGS)
    return frozenset()


def has_any(extensions: tuple[str, ...]) -> bool:
    """Whether this CPU has at least one of `extensions` (an empty tuple needs nothing)."""
    return not extensions or bool(cpu_isa() & frozenset(extensions))
