"""Per-model counters in Triton's metric names (nv_inference_*) plus a batch-size histogram
(kiln_inference_batch_size), rendered in Prometheus' text exposition format for `/metrics`."""
from __future__ import annotations

import threading
from dataclasses import dataclass

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# name -> (help text, attribute of ModelStats); Triton's names and meanings, durations cumulative per request
COUNTERS = {
    "nv_inference_request_success": ("Number of successful inference requests, all batch sizes", "success"),
    "nv_inference_request_failure": ("Number of failed inference requests, all batch sizes", "failure"),
    "nv_inference_count": ("Number of inferences performed (a request of batch size N counts N)", "inference_count"),
    "nv_inference_exec_count": ("Number of model executions performed (a dynamic batch counts once)", "exec_count"),
    "nv_inference_request_duration_us": ("Cumulative inference request duration in microseconds", "request_us"),
    "nv_inference_queue_duration_us": ("Cumulative inference queuing duration in microseconds", "queue_us"),
    "nv_inference_compute_input_duration_us": ("Cumulative compute input duration in microseconds "
                                               "(concatenating a dynamic batch)", "compute_input_us"),
    "nv_inference_compute_infer_duration_us": ("Cumulative compute inference duration in microseconds",
                                               "compute_infer_us"),
    "nv_inference_compute_output_duration_us": ("Cumulative inference compute output duration in microseconds "
                                                "(splitting a dynamic batch)", "compute_output_us"),
}


@dataclass
class ModelStats:
    """One model version's counters; every update holds the lock, so a scrape sees consistent totals."""

    success: int = 0
    failure: int = 0
    inference_count: int = 0
    exec_count: int = 0
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_input_us: float = 0.0
    compute_infer_us: float = 0.0
    compute_output_us: float = 0.0

    def __post_init__(self):
        self.lock = threading.Lock()
        self.batch_buckets = [0] * len(BATCH_SIZE_BUCKETS)
        self.batch_count = 0
        self.batch_sum = 0

    def request_done(self, ok: bool, duration_us: float) -> None:
        with self.lock:
            if ok:
                self.success += 1
            else:
                self.failure += 1
            self.request_us += duration_us

    def execution_done(self, batch_size: int, requests: int, queue_us: float, input_us: float, infer_us: float,
                       output_us: float) -> None:
        """One engine execution of `batch_size` rows for `requests` requests; durations summed over requests,
        compute times counted once per request (Triton's convention)."""
        with self.lock:
            self.exec_count += 1
            self.inference_count += batch_size
            self.queue_us += queue_us
            self.compute_input_us += input_us * requests
            self.compute_infer_us += infer_us * requests
            self.compute_output_us += output_us * requests
            self.batch_count += 1
            self.batch_sum += batch_size
            for i, bound in enumerate(BATCH_SIZE_BUCKETS):
                if batch_size <= bound:
                    self.batch_buckets[i] += 1


def render(models: list[tuple[str, str, ModelStats]]) -> str:
    """Prometheus text format for (model name, version, stats) triples."""
    lines: list[str] = []
    for metric, (help_text, attribute) in COUNTERS.items():
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for name, version, stats in models:
            with stats.lock:
                value = getattr(stats, attribute)
            lines.append(f"{metric}{{{_labels(name, version)}}} {_number(value)}")
    metric = "kiln_inference_batch_size"
    lines += [f"# HELP {metric} Rows per model execution (dynamic batches show as sizes above 1)",
              f"# TYPE {metric} histogram"]
    for name, version, stats in models:
        labels = _labels(name, version)
        with stats.lock:
            for bound, count in zip(BATCH_SIZE_BUCKETS, stats.batch_buckets):   # cumulative, as Prometheus wants
                lines.append(f'{metric}_bucket{{{labels},le="{bound}"}} {count}')
            lines += [f'{metric}_bucket{{{labels},le="+Inf"}} {stats.batch_count}',
                      f"{metric}_sum{{{labels}}} {stats.batch_sum}", f"{metric}_count{{{labels}}} {stats.batch_count}"]
    return "\n".join(lines) + "\n"


def _labels(name: str, version: str) -> str:
    escaped = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'model="{escaped}",version="{version}"'


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"
