"""Fixtures for kiln.native's tests: a fresh kernel cache per test, and the skip where no C compiler is."""
from __future__ import annotations

import pytest

from kiln import native


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """KILN_CACHE_DIR in a new temporary folder, this process's probe and loaded libraries forgotten; yields the
    cache root (kernels go to root / "kernels")."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    native.reset()
    yield root
    native.reset()


@pytest.fixture
def compiler():
    if not native.available():
        pytest.skip("no C compiler that builds kiln's kernels")
    return native.toolchain()
