"""The kernel cache key covers everything that decides the compiled code: the source and the headers it includes,
the compiler's path and version, flags, libraries and the CPU; nothing else."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from kiln.native import LIBRARIES, catalog
from kiln.native.cache import cache_key
from kiln.native.catalog import translation_unit
from kiln.native.compiler import Toolchain

BASE = Toolchain("/usr/bin/cc", "cc (Debian 12.2.0-14) 12.2.0", ("-O3", "-march=native", "-Wall"), ("-lm",),
                 "model name\t: AMD EPYC\nflags\t\t: avx2 avx512f")
GEMM = translation_unit(LIBRARIES["gemm"])


def test_the_same_inputs_give_the_same_key():
    assert cache_key("gemm", GEMM, BASE) == cache_key("gemm", GEMM, dataclasses.replace(BASE))
    assert len(cache_key("gemm", GEMM, BASE)) == 32


@pytest.mark.parametrize("change", [
    dict(version="cc (Debian 12.2.0-14) 12.3.0"),                   # a compiler upgrade
    dict(compiler="/usr/local/bin/cc"),
    dict(flags=("-O3", "-march=native", "-Wall", "-fsanitize=address,undefined")),
    dict(flags=("-O2", "-march=native", "-Wall")),
    dict(libs=("-lmvec", "-lm")),
    dict(cpu="model name\t: AMD EPYC\nflags\t\t: avx2"),            # another ISA: -march=native differs
], ids=lambda c: next(iter(c)))
def test_the_key_changes_with_the_toolchain(change):
    assert cache_key("gemm", GEMM, dataclasses.replace(BASE, **change)) != cache_key("gemm", GEMM, BASE)


def test_the_key_changes_with_the_source_and_the_name():
    assert cache_key("gemm", GEMM + "\n/* edited */\n", BASE) != cache_key("gemm", GEMM, BASE)
    assert cache_key("gemm2", GEMM, BASE) != cache_key("gemm", GEMM, BASE)
    from kiln.tactics.winograd import rendered_source

    two, four = (translation_unit(LIBRARIES["winograd"], rendered_source(m)) for m in (2, 4))
    assert cache_key("winograd", two, BASE) != cache_key("winograd", four, BASE)


def test_the_key_changes_with_an_included_header(tmp_path, monkeypatch):
    """gemm.c includes gemm.h: editing only the header must rebuild the library."""
    csrc = tmp_path / "csrc"
    shutil.copytree(catalog.CSRC, csrc)
    monkeypatch.setattr(catalog, "CSRC", csrc)
    catalog.source_text.cache_clear()
    try:
        before = cache_key("gemm", GEMM, BASE)
        assert before == cache_key("gemm", GEMM, BASE)
        (csrc / "gemm.h").write_text((csrc / "gemm.h").read_text() + "\n/* edited */\n")
        catalog.source_text.cache_clear()
        assert cache_key("gemm", GEMM, BASE) != before
    finally:
        catalog.source_text.cache_clear()


def test_every_library_in_the_table_names_a_csrc_file_or_a_renderer():
    for spec in LIBRARIES.values():
        assert (spec.source is None) == ("whole" in spec.rendered_by), spec.name
        if spec.source is not None:
            assert (catalog.CSRC / spec.source).is_file(), spec.source
    with pytest.raises(ValueError, match="kernel library 'winograd' needs the tile size M"):
        translation_unit(LIBRARIES["winograd"])


def test_gemm_tile_is_defined_once_in_c():
    from kiln.tactics import gemm_c

    assert (gemm_c.PANEL, gemm_c.ROW_TILE) == (catalog.header_constant("gemm.h", "NR"),
                                                catalog.header_constant("gemm.h", "MR")) == (32, 6)
    assert "#define NR" not in catalog.source_text("gemm.c") + catalog.source_text("winograd.c")
