"""The verified kernel cache: a private folder, a record per library, and libraries that kiln did not build (planted)
or that changed since (altered) refused with a warning naming them, deleted and built again, never loaded."""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess

import pytest
import torch

from kiln import native
from kiln.native import cache

# A library with the reformat kernel's symbols whose constructor leaves a mark: loading it once would show.
PLANTED = r"""
#include <stdint.h>
#include <stdio.h>
__attribute__((constructor)) static void mark(void) { FILE* f = fopen(MARK_PATH, "w"); if (f) fclose(f); }
void kiln_to_nhwc(const void* x, void* y, int64_t n, int64_t c, int64_t hw, int64_t io) { (void)x, (void)y, (void)n,
                                                                                       (void)c, (void)hw, (void)io; }
void kiln_to_nchw(const void* x, void* y, int64_t n, int64_t c, int64_t hw, int64_t io) { (void)x, (void)y, (void)n,
                                                                                       (void)c, (void)hw, (void)io; }
"""


def plant(compiler, path, mark):
    source = path.parent / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([compiler.compiler, "-shared", "-fPIC", f'-DMARK_PATH="{mark}"', "-o", str(path), str(source)],
                   check=True)
    source.unlink()


def transposes_exactly() -> bool:
    from kiln.tactics.reformat import to_format

    x = torch.randn(2, 5, 3, 7)
    return torch.equal(to_format(x, "hwc"), x)


def test_kernel_folder_is_private_to_the_user(fresh_cache, compiler):
    native.library("reformat")
    folder = native.kernel_folder()
    assert folder == fresh_cache / "kernels"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()


def test_an_existing_folder_of_this_user_is_narrowed_to_0700(fresh_cache, compiler):
    (fresh_cache / "kernels").mkdir(parents=True, exist_ok=True)
    os.chmod(fresh_cache / "kernels", 0o755)
    native.reset()
    assert native.kernel_folder() == fresh_cache / "kernels"
    assert stat.S_IMODE((fresh_cache / "kernels").stat().st_mode) == 0o700


def test_a_folder_others_may_write_is_refused_for_a_private_temporary_one(fresh_cache, compiler, caplog):
    shared = fresh_cache / "kernels"
    shutil.rmtree(shared, ignore_errors=True)   # what the compiler fixture's probe put there
    shared.mkdir(parents=True, exist_ok=True)
    os.chmod(shared, 0o777)
    native.reset()
    caplog.set_level(logging.WARNING, logger="kiln.native")
    folder = native.kernel_folder()
    assert folder != shared and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert f"cache folder {shared} is writable by group or others (mode 777), so kiln does not use it" in caplog.text
    assert transposes_exactly() and not list(shared.iterdir())   # the kernels came from the temporary folder


def test_a_folder_of_another_user_is_refused(fresh_cache, compiler, monkeypatch, caplog):
    (fresh_cache / "kernels").mkdir(parents=True, exist_ok=True, mode=0o700)
    native.reset()
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    caplog.set_level(logging.WARNING, logger="kiln.native")
    assert native.kernel_folder() != fresh_cache / "kernels"
    assert f"cache folder {fresh_cache / 'kernels'} belongs to another user (uid {me})" in caplog.text


def test_every_built_library_has_a_record_of_its_hash(fresh_cache, compiler):
    native.library("reformat")
    state = native.state("reformat")
    record = json.loads(state.path.with_suffix(".json").read_text())
    assert record["format"] == "kiln-kernel-record" and record["version"] == 1
    assert record["library"] == state.path.name and record["name"] == "reformat"
    assert record["sha256"] == cache.sha256_of(state.path) and record["compiler"] == compiler.compiler
    assert record["compiler_version"] == compiler.version and "-Wall" in record["flags"]
    assert state.built and state.problem is None


def test_a_planted_library_is_refused_deleted_and_rebuilt(fresh_cache, compiler, tmp_path, caplog):
    target = native.state("reformat").path   # where kiln will look for it; nothing is built yet
    target.parent.mkdir(parents=True, exist_ok=True)
    mark = tmp_path / "planted-code-ran"
    plant(compiler, target, mark)
    caplog.set_level(logging.WARNING, logger="kiln.native")
    assert transposes_exactly()   # kiln's own kernel ran, not the planted no-op
    assert not mark.exists(), "the planted library was loaded"
    assert f"kernel library {target} has no record of kiln building it (planted there?): refused, deleted and " \
           "built again" in caplog.text
    assert native.state("reformat").problem is None


def test_an_altered_library_is_refused_deleted_and_rebuilt(fresh_cache, compiler, tmp_path, caplog):
    native.library("reformat")
    target = native.state("reformat").path
    recorded = cache.sha256_of(target)
    mark = tmp_path / "altered-code-ran"
    plant(compiler, target, mark)   # same name, the genuine record still beside it
    native.reset()                  # a new process
    caplog.set_level(logging.WARNING, logger="kiln.native")
    assert transposes_exactly() and not mark.exists()
    assert f"kernel library {target} is not the one kiln built: changed (sha256 " in caplog.text
    assert f"recorded {recorded[:16]})" in caplog.text
    assert native.state("reformat").problem is None


def test_a_verified_library_is_loaded_without_rebuilding(fresh_cache, compiler, caplog):
    native.library("reformat")
    target = native.state("reformat").path
    built = target.stat().st_mtime_ns
    native.reset()
    caplog.set_level(logging.DEBUG, logger="kiln.native")
    native.library("reformat")
    assert target.stat().st_mtime_ns == built and "built" not in caplog.text


def test_no_compiler_means_no_library_and_no_probe(fresh_cache, monkeypatch):
    from tests.native.helpers import hide_compiler

    hide_compiler(monkeypatch)
    assert native.toolchain() is None and not native.available()
    assert native.library("gemm") is None
    assert not (fresh_cache / "kernels").exists()


def test_a_compile_error_says_what_the_compiler_said(fresh_cache, compiler):
    with pytest.raises(native.CompileError, match="this_is_not_c"):
        native.library("pointwise", '#include "pointwise.h"\nint this_is_not_c = ;\n')
