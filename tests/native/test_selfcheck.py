"""Kernel self-checks in a child process (kiln.native.selfcheck): a check that faults, hangs or prints no verdict is
a failed check with the reason, never a crash of the caller; verdicts are cached beside the library they checked and
removed with it."""
from __future__ import annotations

import pytest

from kiln import hardware, native
from kiln.native import cache, selfcheck
from kiln.native.selfcheck import Verdict

CHECK = "tests.native.selfchecks"   # python -m tests.native.selfchecks BEHAVIOUR


@pytest.mark.parametrize("check, want", [
    ("passes", Verdict(True, "max difference 0")),
    ("disagrees", Verdict(False, "max difference 3")),
    ("faults", Verdict(False, "the self-check process was killed by SIGSEGV")),
])
def test_the_child_reports_its_verdict_or_how_it_died(check, want):
    assert selfcheck.run_child(CHECK, (check,)) == want


def test_a_hanging_check_fails_after_its_timeout():
    got = selfcheck.run_child(CHECK, ("hangs",), timeout_s=3)
    assert got == Verdict(False, "the self-check process did not finish in 3 s")


def test_a_check_that_raises_fails_with_the_childs_last_error_line():
    got = selfcheck.run_child(CHECK, ("raises",))
    assert got == Verdict(False, "the self-check process exited with status 1 without a verdict (RuntimeError: no "
                                 "AMX here)")


def test_kilns_amx_checks_run_as_children_and_answer_here():
    for module in ("kiln.tactics.gemm_amx", "kiln.tactics.qgemm_amx"):
        got = selfcheck.run_child(module)
        if not hardware.has_any(("amx_bf16", "amx_int8")):
            assert got == Verdict(False, "Linux did not grant the self-check process AMX state")
        else:   # an AMX CPU: the real kernels against their AVX-512 siblings
            assert got.passed, got.detail


def test_verdicts_are_cached_beside_the_library_and_removed_with_it(fresh_cache, compiler, monkeypatch):
    runs = []
    monkeypatch.setattr(selfcheck, "run_child", lambda module: runs.append(module) or Verdict(False, "differs"))
    native.library("reformat")
    library = native.state("reformat").path
    check = "tests.native.selfchecks"
    assert selfcheck.verdict("reformat", check) == Verdict(False, "differs")
    assert selfcheck.verdict("reformat", check) == Verdict(False, "differs") and runs == [check]   # cached
    saved = selfcheck.verdict_path(library, check)
    assert saved.is_file() and saved.parent == library.parent and saved not in cache.cached_libraries()
    saved.write_text("{not json")   # unreadable: checked again
    assert selfcheck.verdict("reformat", check).passed is False and len(runs) == 2
    cache.remove(library)
    assert not saved.exists() and not library.exists()


def test_a_timeout_is_not_cached(fresh_cache, compiler, monkeypatch):
    monkeypatch.setattr(selfcheck, "run_child",
                        lambda module: Verdict(False, "the self-check process did not finish in 300 s"))
    native.library("reformat")
    selfcheck.verdict("reformat", CHECK)
    assert not selfcheck.verdict_path(native.state("reformat").path, CHECK).exists()
