"""The C libraries a kernel library may link besides libm and OpenMP, found where pip installed them: oneDNN's C
API (libdnnl.so.3 from the `onednn-cpu-gomp` wheel, dnnl.h from `onednn-devel-cpu-gomp`, both installing under
sys.prefix). A library that needs one is built only where it is found (KILN_ONEDNN_ROOT names another prefix);
elsewhere its tactics are not offered, as without a C compiler."""
from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

ONEDNN_ROOT_ENV = "KILN_ONEDNN_ROOT"
ONEDNN_MIN_VERSION = (3, 2)   # per-argument scales and zero points (the v3 API), AMX and VNNI brgemm kernels
ONEDNN_WHEELS = "onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0"


@functools.lru_cache(maxsize=None)
def onednn_prefix() -> Path | None:
    """The prefix holding oneDNN's header and library, or None where there is none (or an older one)."""
    roots = [os.environ.get(ONEDNN_ROOT_ENV, ""), sys.prefix, sys.base_prefix]
    for root in (Path(r) for r in roots if r):
        header, lib = root / "include" / "oneapi" / "dnnl" / "dnnl_version.h", root / "lib" / "libdnnl.so.3"
        if header.is_file() and lib.is_file() and onednn_version(header) >= ONEDNN_MIN_VERSION:
            return root
    return None


def onednn_version(header: Path) -> tuple[int, int]:
    text = header.read_text(errors="replace")
    found = [re.search(rf"#define DNNL_VERSION_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
    return tuple(int(m.group(1)) for m in found) if all(found) else (0, 0)


def build_flags(needs: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(compiler flags, link arguments) for a library that needs `needs` ("" for none), or None where it is
    missing here. The link arguments name the file and its folder (-rpath), so the cache key changes with it."""
    if not needs:
        return (), ()
    if needs != "onednn":
        raise ValueError(f"unknown external library '{needs}'")
    root = onednn_prefix()
    if root is None:
        return None
    lib = root / "lib"
    return (f"-I{root / 'include'}",), (f"-L{lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib}")
