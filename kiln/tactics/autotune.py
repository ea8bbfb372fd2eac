"""The autotuner: times every eligible tactic of a layer on its real shapes and storage types and picks the
cheapest, counting the Reformat copies a tactic's layout would add and the bf16/FP32 conversions its precision would
cost its neighbours; logs trtexec-style timing tables and the reason."""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.errors import ModelError
from kiln.tactics.base import ANY, HWC, LINEAR, LayerView, Tactic, tactic_value
from kiln.tactics.clock import WALL_CLOCK, Clock, elapsed_ms
from kiln.tactics.costs import DEFAULT_COSTS, CostPolicy
from kiln.tactics.reference import as_planned
from kiln.tactics.reformat import to_format
from kiln.tactics.storage import BF16, NO_GUESS, StorageGuess
from kiln.tactics.timing_cache import TimingCache, digest
from kiln.trt import build_log as log_lines

log = logging.getLogger("kiln.build")

@dataclass(frozen=True)
class TimingOptions:
    avg_timing: int = 8      # inferences averaged per measurement (trtexec --avgTiming)
    min_timing: int = 3      # measurement rounds per tactic; the fastest counts (trtexec --minTiming)


@dataclass(frozen=True)
class Choice:
    tactic: Tactic
    kernel_ms: float
    overhead_ms: float   # Reformat copies of the inputs, bf16/FP32 conversions, an external library's hand-over
    timings_ms: dict[str, float]


def layer_signature(view: LayerView, have_formats: list[str | None], precision: str = "FP32") -> str:
    """The timing cache's key for a layer: op, attributes, input shapes/dtypes/layouts, weights, precision."""
    return digest({"op": view.op_type, "domain": view.domain, "attrs": view.attrs,
                   "inputs": list(zip(view.input_shapes, view.input_dtypes, have_formats)),
                   "weights": sorted((i, list(t.shape), str(t.dtype)) for i, t in view.const_inputs.items()),
                   "precision": precision})


def example_input(shape, dtype: str, fmt: str) -> torch.Tensor:
    from kiln.ops.dtypes import to_torch_dtype

    tdtype = to_torch_dtype(np.dtype(dtype))
    if tdtype.is_floating_point:
        t = torch.randn(shape, dtype=tdtype)
    elif tdtype == torch.bool:
        t = torch.zeros(shape, dtype=torch.bool)
    else:
        t = torch.zeros(shape, dtype=tdtype)
    return t.contiguous(memory_format=torch.channels_last) if fmt == HWC and len(shape) == 4 else t


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(folder: Path = CPU_CACHES) -> int:
    """The largest CPU cache that sysfs reports (L3 here), or 32 MiB where it cannot be read."""
    sizes = []
    for entry in folder.glob("index*/size"):
        text = entry.read_text().strip() if entry.is_file() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}.get(text[-1].upper(), 0))
    return max(sizes, default=32 << 20)


class CacheEvictor:
    """Makes a timed run see the caches a plan's layer sees when the model's weights outgrow the last-level
    cache: its weights come from memory (every other layer's weights passed through since its last run) while
    its input activations are in cache (the previous layer just wrote them). Before each run a buffer 1.5x the
    last-level cache is written over, then the inputs are read back in. Hot-cache timing had chosen Winograd
    F(4x4) for ResNet-50's 14x14 layers: 0.61 ms alone, 0.87-0.96 ms in the plan, where F(2x2), whose
    transformed weights are 2.25x smaller, ran 0.82-0.85."""

    def __init__(self):
        self.buffer = torch.empty(last_level_cache_bytes() * 3 // 8, dtype=torch.float32)

    def time_ms(self, fn, inputs: list, runs: int, clock: Clock = WALL_CLOCK) -> list[float]:
        samples = []
        for _ in range(runs):
            self.buffer.fill_(1.0)
            for x in inputs:
                if x is not None:
                    x.sum()
            samples.append(elapsed_ms(clock, fn))
        return samples


def robust_ms(rounds_ms: list[float]) -> float:
    """A tactic's time from its measurement rounds: the fastest round. Noise on a shared machine only ever adds
    time, in bursts that can cover whole rounds: a median over all samples once timed ResNet-50's stem on oneDNN
    at 2.24 ms (1.2-1.4 ms in every other build), chose torch's NCHW kernel there, and NCHW pooling after it."""
    return min(rounds_ms)


def time_rounds_ms(fn, options: TimingOptions, clock: Clock = WALL_CLOCK) -> list[float]:
    """One untimed call, then `min_timing` rounds of `avg_timing` calls: each round's mean call time."""
    fn()
    return [elapsed_ms(clock, fn, options.avg_timing) for _ in range(options.min_timing)]


class Autotuner:
    def __init__(self, cache: TimingCache, options: TimingOptions = TimingOptions(), cold_weights: bool = False,
                 costs: CostPolicy = DEFAULT_COSTS, clock: Clock = WALL_CLOCK):
        """`cold_weights`: time each run after evicting the caches (`CacheEvictor`), for models whose weights
        fill more than half the last-level cache (kiln.builder.build.autotuner); such timings are cached apart from
        hot ones. `costs`: the margins and hand-over costs choices add; `clock`: what every measurement reads
        (segment and plan timing too)."""
        self.cache, self.options, self.costs, self.clock = cache, options, costs, clock
        self.evictor = CacheEvictor() if cold_weights else None
        self.current = ""   # the layer being tuned, for messages
        self.on_timing = None   # progress: called with a description of each measurement before it runs

    def reformat_ms(self, shape, dtype: str, target: str) -> float:
        key = digest({"reformat": list(shape), "dtype": dtype, "to": target})
        cached = self.cache.get(key, "reformat")
        if cached is not None:
            return cached
        src = example_input(shape, dtype, LINEAR if target == HWC else HWC)
        ms = robust_ms(time_rounds_ms(lambda: to_format(src, target), self.options, self.clock))
        self.cache.put(key, "reformat", ms)
        return ms

    def convert_ms(self, shape, dtype: str) -> float:
        """One pass converting a float tensor of `shape` into `dtype` (bfloat16 <-> float32): what a layer whose
        kernel cannot read or write the type its neighbours store costs them (timed once, cached)."""
        key = digest({"convert": list(shape), "to": dtype})
        cached = self.cache.get(key, "convert")
        if cached is not None:
            return cached
        src = torch.randn(shape, dtype=torch.float32 if dtype == "bfloat16" else torch.bfloat16)
        target = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        ms = robust_ms(time_rounds_ms(lambda: src.to(target), self.options, self.clock))
        self.cache.put(key, "convert", ms)
        return ms

    def _measure(self, views: dict[str, LayerView], tactics: list[Tactic], signatures: dict[str, str],
                 have_formats: list[str | None], dying: frozenset[int]) -> dict[str, float]:
        """Each tactic's time on its own view of the layer (the storage types it would read and write)."""
        times: dict[str, float] = {}
        pending = []
        for t in tactics:
            cached = self.cache.get(signatures[t.name], t.name, self.current)
            if cached is None:
                pending.append(t)
            else:
                times[t.name] = cached
        runners = [r for r in (self._runner(t, views[t.name], have_formats, dying, times) for t in pending) if r]
        with torch.inference_mode():
            runners = [r for r in runners if self._first_call(r, times)]   # lazy initialisation, not timed
            for _ in range(self.options.min_timing):   # interleave candidates so drift hits all alike
                for t, fn, xs, rounds in runners:
                    rounds.append(statistics.median(self.evictor.time_ms(fn, xs, self.options.avg_timing, self.clock))
                                  if self.evictor else
                                  time_rounds_ms(fn, TimingOptions(self.options.avg_timing, 1), self.clock)[0])
        for t, _, _, rounds in runners:
            times[t.name] = robust_ms(rounds)
            self.cache.put(signatures[t.name], t.name, times[t.name])
        return times

    def _runner(self, t: Tactic, view: LayerView, have_formats: list[str | None], dying: frozenset[int],
                times: dict[str, float]):
        """(tactic, a call on example inputs, the inputs, its rounds), or None where preparing the kernel fails."""
        if self.on_timing is not None:
            self.on_timing(f"{t.name} for {self.current}")
        try:
            kernel = t.prepare(view)
        except RuntimeError as exc:
            self._skip(t, exc, times)
            return None
        wanted = t.input_formats(view)
        if getattr(t, "outputs_as_planned", False):   # timed as the plan runs it: outputs in the layout it records
            kernel = as_planned(kernel, [t.output_format(view, [f or LINEAR for f in have_formats])] *
                                len(view.output_dtypes))
        # a layout-agnostic kernel is timed on the layout its producer really delivers
        xs = [None if (s is None or i in view.const_inputs) else
              example_input(s, view.input_dtypes[i], (have_formats[i] or LINEAR) if wanted[i] == ANY else wanted[i])
              for i, s in enumerate(view.input_shapes)]
        into = getattr(kernel, "into_input", None)
        if into is not None and into[0] in dying:
            kernel = into[1]   # the plan will run it over the dying input's buffer: time it that way
        return t, lambda: kernel(xs), xs, []

    def _first_call(self, runner, times: dict[str, float]) -> bool:
        try:
            runner[1]()
            return True
        except RuntimeError as exc:
            self._skip(runner[0], exc, times)
            return False

    def _skip(self, t: Tactic, exc: Exception, times: dict[str, float]) -> None:
        """TensorRT's "Skipping tactic ... due to failure": a kernel the library refuses here (torch's oneDNN
        without the ISA it needs, say) is left out of this layer's race with a warning, never cached."""
        log.warning("Skipping tactic %s for %s: it failed here (%s)", t.name, self.current,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        times[t.name] = math.inf

    def _signature(self, view: LayerView, have_formats: list[str | None], precision: str,
                   dying: frozenset[int]) -> str:
        signature = layer_signature(view, have_formats, precision)
        if BF16 in view.output_dtypes:
            signature = digest({"outputs": list(view.output_dtypes), "layer": signature})
        if dying:
            signature = digest({"dying": sorted(dying), "layer": signature})
        if self.evictor is not None:
            signature = digest({"cold_weights": signature})
        return signature

    def _conversions_ms(self, view: LayerView, stored: StorageGuess, widen: tuple[int, ...], narrow: bool) -> float:
        """The bf16 <-> FP32 passes a tactic's choice would cost its neighbours: the guessed bf16 inputs it would
        widen and, with `narrow`, its output rounded for readers that store it in bf16 (StorageGuess.timing_view)."""
        return (sum(self.convert_ms(view.input_shapes[i], "float32") for i in widen)
                + (self.convert_ms(stored.output_shape, BF16) if narrow else 0.0))

    def choose(self, name: str, view: LayerView, tactics: list[Tactic], have_formats: list[str | None],
               runner_names: dict[str, str], dying: frozenset[int] = frozenset(), precision: str = "FP32",
               stored: StorageGuess = NO_GUESS) -> Choice:
        """`dying`: indices of inputs this layer reads last; a kernel that can write its output over one of
        them (`into_input`, a fused residual) is timed doing so, as the plan runs it (kiln.runtime.donation).
        `precision`: the layer's granted precision (part of the timing cache's key). `stored`: the bf16 tensors
        expected around the layer: kernels that read or write them so are timed doing it, the others are charged
        the conversions."""
        timing = {t.name: stored.timing_view(view, t) for t in tactics}   # (view, inputs to widen, narrow output)
        views = {name: seen[0] for name, seen in timing.items()}
        signatures = {t.name: self._signature(views[t.name], have_formats, precision, dying) for t in tactics}
        self.current = f"layer '{name}'"
        log.debug(log_lines.computing_costs(name))
        times = self._measure(views, tactics, signatures, have_formats, dying)
        best: Choice | None = None
        for t in tactics:
            if math.isinf(times[t.name]):   # failed here (_skip warned)
                continue
            runner = runner_names.get(t.name, t.source)
            wanted = t.input_formats(view)
            reformat = sum(self.reformat_ms(view.input_shapes[i], view.input_dtypes[i], w)
                           for i, (w, have) in enumerate(zip(wanted, have_formats))
                           if have is not None and w not in (ANY, have) and len(view.input_shapes[i]) == 4)
            convert = self._conversions_ms(view, stored, *timing[t.name][1:])
            handover = self.costs.handover_ms.get(t.source, 0.0)
            log.debug(log_lines.timing_runner(name, runner))
            log.debug(log_lines.tactic_time(t.name, tactic_value(t.name), times[t.name]))
            if reformat:
                log.debug("  + input reformat %g ms (layout %s)", reformat, "/".join(w for w in wanted))
            if convert:
                log.debug("  + bf16/FP32 conversions %g ms (its neighbours store bf16)", convert)
            if handover:
                log.debug("  + thread-pool hand-over %g ms (%s)", handover, t.source)
            total = times[t.name] + reformat + convert + handover
            if best is None or total < (best.kernel_ms + best.overhead_ms) * (1 - self.costs.preference_margin):
                best = Choice(t, times[t.name], reformat + convert + handover, times)
        if best is None:
            raise ModelError(f"every tactic for layer '{name}' failed on this CPU ({', '.join(times)}); the build "
                             f"log's warnings say why")
        log.debug(log_lines.chose_runner(runner_names.get(best.tactic.name, best.tactic.source),
                                         tactic_value(best.tactic.name)))
        others = ", ".join(f"{k} {v:g} ms" for k, v in times.items() if k != best.tactic.name)
        log.debug("Reason: %s wins at %g ms kernel + %g ms reformats/conversions/hand-over (others: %s; a later-listed "
                  "tactic must be %d%% faster)", best.tactic.name, best.kernel_ms, best.overhead_ms, others or "none",
                  round(self.costs.preference_margin * 100))
        return best
