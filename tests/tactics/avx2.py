"""A kernel library compiled for AVX2 alone (-march=x86-64-v3: 8-float vectors, as on the Zen 3 machines this
project also runs on), so that its narrower-vector paths are tested on AVX-512 CPUs too."""
from __future__ import annotations

import ctypes
from pathlib import Path

from kiln import native
from kiln.native import catalog, compiler


def avx2_build(name: str, folder: Path):
    """catalog library `name` built for x86-64-v3 into `folder`, its functions bound as kiln binds them."""
    spec = catalog.LIBRARIES[name]
    target = Path(folder) / f"{name}_avx2.so"
    compiler.compile_unit(native.toolchain(), catalog.translation_unit(spec), target, spec.source,
                          ("-march=x86-64-v3",))
    return catalog.bind(ctypes.CDLL(str(target)), spec)
