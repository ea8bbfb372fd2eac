"""Dynamic batching seen from outside: concurrent batch-1 requests run in fewer executions (the metrics say so),
each answer equals Engine.run on that request alone, and requests of other shapes never share a batch."""
from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")


def scrape(url: str) -> dict[str, float]:
    """The conv model's metric samples: 'name' or 'name{le=...}' -> value."""
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r'(\w+)\{model="conv",version="1"(?:,le="([^"]+)")?\} (\S+)$', line)
        if m:
            samples[m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")] = float(m.group(3))
    return samples


def infer_concurrently(url: str, images: list[np.ndarray]) -> list[np.ndarray]:
    """All requests in flight at once: tritonclient's async_infer on a connection pool of that size."""
    client = tritonhttp.InferenceServerClient(url, concurrency=len(images))
    pending = []
    for image in images:
        item = tritonhttp.InferInput("image", list(image.shape), "FP32")
        item.set_data_from_numpy(image)
        pending.append(client.async_infer("conv", [item]))
    answers = [p.get_result().as_numpy("probs") for p in pending]
    client.close()
    return answers


def test_concurrent_requests_are_batched_and_split_back(server, loaded):
    rng = np.random.default_rng(11)
    small = [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(12)]
    large = [rng.standard_normal((1, 3, 24, 24)).astype(np.float32) for _ in range(4)]
    images = small + large
    before = scrape(server.http_url)
    answers = infer_concurrently(server.http_url, images)
    after = scrape(server.http_url)
    for image, answer in zip(images, answers):   # 16x16 and 24x24 requests mixed would not even concatenate
        np.testing.assert_array_equal(answer, loaded["conv"].run({"image": image})["probs"])
    requests = after["nv_inference_request_success"] - before["nv_inference_request_success"]
    executions = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    assert requests == len(images)
    assert after["nv_inference_count"] - before["nv_inference_count"] == len(images)
    assert executions < requests, f"{requests} requests ran in {executions} executions: nothing was batched"
    batches_of_one = after["kiln_inference_batch_size_bucket[1]"] - before["kiln_inference_batch_size_bucket[1]"]
    assert batches_of_one < executions, "the histogram shows no batch larger than 1"
    assert after["kiln_inference_batch_size_sum"] - before["kiln_inference_batch_size_sum"] == len(images)
    assert after["nv_inference_queue_duration_us"] > before["nv_inference_queue_duration_us"]
    assert after["nv_inference_compute_infer_duration_us"] > before["nv_inference_compute_infer_duration_us"]


def test_metrics_text_format(server):
    text = urllib.request.urlopen(f"http://{server.http_url}/metrics", timeout=10).read().decode()
    for name in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                 "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                 "nv_inference_compute_infer_duration_us"):
        assert f"# TYPE {name} counter" in text
        assert re.search(rf'^{name}\{{model="mlp",version="1"\}} \d', text, re.M), name
    assert "# TYPE kiln_inference_batch_size histogram" in text
    assert 'kiln_inference_batch_size_bucket{model="conv",version="1",le="+Inf"}' in text
