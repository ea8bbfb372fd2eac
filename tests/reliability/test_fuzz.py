"""Property-based fuzzing (hypothesis) of everything that reads files: engines (also with the checksum re-sealed,
so the JSON plan and weights are parsed), ONNX models, and TensorRT artifacts (layer info, one-line dumps,
verbose logs). Every mutation must end in success or a clean `kiln.Error`, within a time bound."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fuzz import targets  # noqa: E402

EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6)
FUZZ = settings(max_examples=120, deadline=5000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@functools.lru_cache(maxsize=None)
def engine_seed() -> bytes:
    return targets.seed_engine()


@FUZZ
@given(edits=EDITS, reseal=st.booleans())
def test_mutated_engines_load_cleanly_or_are_refused(edits, reseal):
    data = targets.mutate(engine_seed(), edits)
    targets.target_engine(targets.reseal(data) if reseal else data)


@FUZZ
@given(edits=EDITS)
def test_mutated_onnx_models_import_cleanly_or_are_refused(edits):
    targets.target_onnx(targets.mutate(targets.seed_model_bytes(), edits))


@pytest.mark.parametrize("fixture", [p.name for p in targets.TRT_FIXTURES])
def test_mutated_tensorrt_artifacts_read_cleanly_or_are_refused(fixture):
    seed = (targets.FIXTURES / fixture).read_bytes()[:20000]

    @FUZZ
    @given(edits=EDITS)
    def check(edits):
        targets.target_trt(targets.mutate(seed, edits))

    check()
