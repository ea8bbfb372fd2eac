"""The dynamic batcher, scheduling as Triton's does: requests queue per model; each instance (an execution
context with its own thread) takes its next batch itself whenever it is idle: the oldest request and the queued
ones with the same non-batch shapes, concatenated along axis 0 and split back after the run. A batch launches at
once when it is full or when a queued request cannot join it (too many rows, other shapes); otherwise it waits
until its oldest request has waited the queue delay (Triton's `max_queue_delay_microseconds`)."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import Error, InputError
from kiln.runtime.executor import check_shapes
from kiln.serve.metrics import ModelStats
from kiln.serve.protocol import InferenceFailedError

log = logging.getLogger("kiln.serve")


@dataclass(frozen=True)
class BatchPolicy:
    """`max_batch_size` rows per execution (1: no batching); a request waits up to `max_queue_delay_us` for
    others to join it."""

    max_batch_size: int = 1
    max_queue_delay_us: int = 0


@dataclass
class _Pending:
    feeds: dict[str, np.ndarray]
    rows: int
    key: tuple
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


class Batcher:
    """Runs requests for one engine on `instances` execution contexts. `submit` is thread-safe and returns a
    concurrent Future of the output dict; cancelling it while queued drops the request unrun."""

    def __init__(self, engine, policy: BatchPolicy, stats: ModelStats, instances: int = 1, name: str = "model"):
        self.engine, self.policy, self.stats, self.name = engine, policy, stats, name
        self._pending: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        contexts = [engine.create_execution_context() for _ in range(instances)]
        self._threads = [threading.Thread(target=self._run_instance, args=(ctx,), daemon=True,
                                          name=f"kiln-serve-{name}-instance-{i}") for i, ctx in enumerate(contexts)]
        for thread in self._threads:
            thread.start()

    def submit(self, feeds: dict[str, np.ndarray]) -> concurrent.futures.Future:
        batching = self.policy.max_batch_size > 1
        rows = int(next(iter(feeds.values())).shape[0]) if batching else 1
        key = tuple((n, a.shape[1:]) for n, a in sorted(feeds.items())) if batching else ()
        item = _Pending(feeds, rows, key)
        with self._cond:
            if self._stopping:
                raise InferenceFailedError(f"model '{self.name}' is shutting down; request not accepted")
            self._pending.append(item)
            self._cond.notify_all()
        return item.future

    @property
    def accepting(self) -> bool:
        return not self._stopping

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then end the threads (the drain on shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    # --- batch forming (on the instance threads, under the lock) --------------------------------------------
    def _take_batch(self) -> list[_Pending] | None:
        """The next batch for an idle instance, waiting for requests and for the queue delay; None: stopping
        with nothing queued. The delay runs only while the batch could still grow."""
        delay_ns = self.policy.max_queue_delay_us * 1000
        with self._cond:
            while True:
                while self._pending and self._pending[0].future.cancelled():
                    self._pending.popleft()   # its client is gone: nothing to run, nothing to wait for
                if not self._pending:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                first = self._pending[0]
                batch, can_grow = self._compatible(first)
                remaining_ns = first.enqueued_ns + delay_ns - time.perf_counter_ns()
                if not can_grow or remaining_ns <= 0 or self._stopping:
                    for item in batch:
                        self._pending.remove(item)
                    return batch
                self._cond.wait(remaining_ns / 1e9)   # another instance may take `first` meanwhile

    def _compatible(self, first: _Pending) -> tuple[list[_Pending], bool]:
        """`first` and the queued requests after it with the same non-batch shapes, oldest first, while the
        rows fit the batch limit and the engine's optimization profiles; and whether the batch could still grow.
        It cannot when it is full or when a queued request had to be left out (too many rows, other shapes):
        Triton sends such a batch now rather than holding it, and the request left out, for the queue delay."""
        batch, rows = [first], first.rows
        for item in self._pending:
            if item is first or item.future.cancelled():
                continue
            if item.key != first.key or not self._fits(first, rows + item.rows):
                return batch, False
            batch.append(item)
            rows += item.rows
        return batch, rows < self.policy.max_batch_size

    def _fits(self, first: _Pending, rows: int) -> bool:
        if rows > self.policy.max_batch_size:
            return False
        try:
            check_shapes(self.engine.plan, {n: (rows, *a.shape[1:]) for n, a in first.feeds.items()})
        except InputError:
            return False
        return True

    # --- instance threads ------------------------------------------------------------------------------------
    def _run_instance(self, ctx) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            live = [p for p in batch if p.future.set_running_or_notify_cancel()]   # drop cancelled ones
            if live:
                self._execute(ctx, live)

    def _execute(self, ctx, batch: list[_Pending]) -> None:
        start_ns = time.perf_counter_ns()
        queue_us = sum(start_ns - p.enqueued_ns for p in batch) / 1000
        try:
            feeds = batch[0].feeds if len(batch) == 1 else \
                {n: np.concatenate([p.feeds[n] for p in batch]) for n in batch[0].feeds}
            input_ns = time.perf_counter_ns()
            outputs = ctx.execute(feeds)
            infer_ns = time.perf_counter_ns()
            parts = [outputs] if len(batch) == 1 else _split(outputs, [p.rows for p in batch])
        except Exception as exc:   # noqa: BLE001 - a kernel failure fails its own request(s), never the server
            if len(batch) > 1:     # one bad request must not fail the others: run each on its own
                for item in batch:
                    self._execute(ctx, [item])
                return
            batch[0].future.set_exception(_as_request_error(exc, self.name))
            return
        end_ns = time.perf_counter_ns()
        self.stats.execution_done(sum(p.rows for p in batch), len(batch), queue_us, (input_ns - start_ns) / 1000,
                                  (infer_ns - input_ns) / 1000, (end_ns - infer_ns) / 1000)
        for item, part in zip(batch, parts):
            item.future.set_result(part)


def _split(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]]:
    total = sum(rows)
    bad = [n for n, a in outputs.items() if a.ndim == 0 or a.shape[0] != total]
    if bad:
        raise InferenceFailedError(f"output '{bad[0]}' has no batch axis of {total} rows; cannot split a batch")
    bounds = np.cumsum(rows)[:-1]
    pieces = {n: np.split(a, bounds) for n, a in outputs.items()}
    return [{n: np.ascontiguousarray(pieces[n][i]) for n in outputs} for i in range(len(rows))]


def _as_request_error(exc: Exception, model: str) -> Exception:
    if isinstance(exc, InputError):
        return exc
    log.warning("model '%s': inference failed: %s: %s", model, type(exc).__name__, exc)
    if isinstance(exc, Error):
        return exc
    return InferenceFailedError(f"model '{model}': inference failed: {type(exc).__name__}: {exc}")
