"""The CPU a benchmark ran on, as one line every benchmark prints first: lscpu's model name and whether each
ISA extension that changes kiln's or its peers' kernels is present (the machines vary: AVX2-only, AVX-512,
AMX; a number without its CPU cannot be compared with another)."""
from __future__ import annotations

import subprocess
from pathlib import Path

# The extensions that decide which kernels run: AVX2/AVX-512 FP32 paths, BF16/FP16 arithmetic (OpenVINO's bf16
# default, --bf16/--fp16), VNNI (INT8 dot products) and AMX tiles (BF16/INT8 matrix units).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def lscpu_text() -> str:
    """`lscpu`'s output, or /proc/cpuinfo's text where lscpu is missing; empty when neither can be read."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        try:
            return Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""


def parse_cpu(text: str) -> tuple[str, frozenset[str]]:
    """(model name, CPU flags) from lscpu's `Model name:`/`Flags:` lines or /proc/cpuinfo's `model name`/`flags`."""
    model, flags = "unknown CPU", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep:
            continue
        if key == "model name" and model == "unknown CPU":
            model = value.strip() or model
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def present_isa(flags: frozenset[str]) -> list[str]:
    """The ISA_FLAGS this CPU has, in ISA_FLAGS order."""
    return [f for f in ISA_FLAGS if f in flags]


def cpu_line(text: str | None = None) -> str:
    """'CPU: AMD EPYC; avx2 yes, avx512f yes, ..., amx_int8 no' (every ISA_FLAGS entry, present or absent)."""
    model, flags = parse_cpu(lscpu_text() if text is None else text)
    return f"CPU: {model}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ISA_FLAGS)
