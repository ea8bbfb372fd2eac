"""KServe's own REST client (`kserve.InferenceRESTClient`, v2 protocol) against `kiln serve`: health, model
readiness and inference with JSON and binary tensors."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.serve.conftest import ROOT

# kserve is not imported here: its protobuf messages would clash with tritonclient.grpc's in this process
pytestmark = pytest.mark.skipif(importlib.util.find_spec("kserve") is None, reason="kserve is not installed")


def test_kserve_rest_client_json_and_binary(server, loaded, tmp_path):
    image = np.random.default_rng(5).standard_normal((3, 3, 12, 12)).astype(np.float32)
    np.save(tmp_path / "image.npy", image)
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "serve" / "kserve_client.py"), server.http_url,
                          str(tmp_path / "image.npy")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert (result["live"], result["ready"], result["model_ready"]) == (True, True, True)
    expected = loaded["conv"].run({"image": image})["probs"]
    for mode in ("json", "binary"):
        assert result[mode]["id"] == f"ks-{mode}" and result[mode]["model_name"] == "conv"
        assert result[mode]["shape"] == [3, 5]
        np.testing.assert_array_equal(np.array(result[mode]["probs"], np.float32), expected)
