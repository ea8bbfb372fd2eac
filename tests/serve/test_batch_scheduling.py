"""When the dynamic batcher launches a batch, against Triton's documented rules (docs/user_guide/batcher.md,
"Delayed Batching", and core's DynamicBatchScheduler::GetDynamicBatch): a batch that cannot grow (full, or a
queued request that cannot join it) goes at once, however long the queue delay; one that could still grow waits
until its oldest request has waited the delay, and no longer. Driven on the Batcher itself with the conv engine,
so the timings are the scheduler's, not a client's or the network's."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kiln.serve.batcher import Batcher, BatchPolicy
from kiln.serve.metrics import ModelStats

LONG_DELAY_US = 5_000_000   # 5 s: a batch held for the delay would blow every bound below
PROMPT_S = 2.0              # "at once", with room for a loaded 2-core machine


@pytest.fixture
def conv(loaded):
    return loaded["conv"]


def images(rows: int, side: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, side, side)).astype(np.float32)


def start(engine, delay_us: int, instances: int = 1) -> tuple[Batcher, ModelStats]:
    stats = ModelStats()
    return Batcher(engine, BatchPolicy(8, delay_us), stats, instances, "conv"), stats


def check(engine, future, image: np.ndarray, timeout_s: float) -> None:
    got = future.result(timeout=timeout_s)["probs"]
    np.testing.assert_allclose(got, engine.run({"image": image})["probs"], rtol=1e-5, atol=1e-6)


def test_a_full_batch_launches_without_waiting_for_the_delay(conv):
    batcher, stats = start(conv, LONG_DELAY_US)
    try:
        feeds = [images(1, seed=i) for i in range(8)]
        t0 = time.perf_counter()
        futures = [batcher.submit({"image": x}) for x in feeds]
        for future, image in zip(futures, feeds):
            check(conv, future, image, PROMPT_S)
        assert time.perf_counter() - t0 < PROMPT_S
        assert (stats.exec_count, stats.batch_sum) == (1, 8)
    finally:
        batcher.stop()


def test_a_request_too_large_to_join_sends_the_pending_batch_now(conv):
    """5 rows queued, then 4: 9 > 8 cannot run together, so the 5 go now instead of after 5 s (the 4 then
    wait for company: they are alone and could still grow)."""
    batcher, stats = start(conv, LONG_DELAY_US)
    try:
        five, four = images(5, seed=1), images(4, seed=2)
        t0 = time.perf_counter()
        first, second = batcher.submit({"image": five}), batcher.submit({"image": four})
        check(conv, first, five, PROMPT_S)
        assert time.perf_counter() - t0 < PROMPT_S
        assert not second.done(), "a lone request of 4 rows (batch could grow to 8) should wait for the delay"
        three = images(3, seed=3)    # 4 + 3 still < 8; then 1 more row fills the batch: it goes at once
        third, fourth = batcher.submit({"image": three}), batcher.submit({"image": images(1, seed=4)})
        check(conv, second, four, PROMPT_S)
        check(conv, third, three, PROMPT_S)
        fourth.result(timeout=PROMPT_S)
        assert time.perf_counter() - t0 < 2 * PROMPT_S
        assert (stats.exec_count, stats.batch_sum) == (2, 13)
    finally:
        batcher.stop()


def test_a_request_of_other_shapes_sends_the_pending_batch_now(conv):
    batcher, _ = start(conv, LONG_DELAY_US)
    try:
        small, large = images(1, side=16, seed=5), images(1, side=24, seed=6)
        t0 = time.perf_counter()
        first, second = batcher.submit({"image": small}), batcher.submit({"image": large})
        check(conv, first, small, PROMPT_S)
        assert time.perf_counter() - t0 < PROMPT_S
    finally:
        batcher.stop()   # the shutdown drain runs the 24x24 request without waiting out its delay
    check(conv, second, large, 0)


def test_a_lone_request_waits_the_queue_delay_and_no_longer(conv):
    """Triton holds a batch that could still grow until its oldest request has waited the delay: a single
    client sending one row at a time sees each request take the delay plus the compute."""
    delay_s = 0.3
    batcher, stats = start(conv, int(delay_s * 1e6))
    try:
        for seed in range(2):
            image = images(1, seed=seed)
            t0 = time.perf_counter()
            check(conv, batcher.submit({"image": image}), image, 10)
            elapsed_s = time.perf_counter() - t0
            assert delay_s <= elapsed_s < delay_s + PROMPT_S, elapsed_s
        assert (stats.exec_count, stats.batch_sum) == (2, 2)
    finally:
        batcher.stop()


def test_shutdown_runs_what_is_queued_at_once(conv):
    batcher, _ = start(conv, LONG_DELAY_US, instances=2)
    image = images(2, seed=7)
    future = batcher.submit({"image": image})
    t0 = time.perf_counter()
    batcher.stop()
    assert time.perf_counter() - t0 < PROMPT_S
    check(conv, future, image, 0)


def test_serving_threads_leave_a_core_to_the_event_loop():
    from kiln.serve.repository import serving_threads

    assert [serving_threads(1, cores=c) for c in (1, 2, 3, 16)] == [1, 1, 2, 15]
    assert [serving_threads(k, cores=16) for k in (2, 4, 32)] == [7, 3, 1]
