"""Console output in trtexec's style: `[MM/DD/YYYY-HH:MM:SS] [I] message`, plus kiln's layer table."""
from __future__ import annotations

import logging
import sys
import time

LEVEL_TAGS = {logging.DEBUG: "V", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}


class TrtexecFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%m/%d/%Y-%H:%M:%S", time.localtime(record.created))
        tag = "[kiln] " if record.name.startswith("kiln") else ""
        return f"[{stamp}] [{LEVEL_TAGS.get(record.levelno, 'I')}] {tag}{record.getMessage()}"


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(TrtexecFormatter())
    root = logging.getLogger("kiln")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def info(message: str = "") -> None:
    print(f"[{time.strftime('%m/%d/%Y-%H:%M:%S')}] [I] {message}")


def error(message: str) -> None:
    print(f"[{time.strftime('%m/%d/%Y-%H:%M:%S')}] [E] {message}", file=sys.stderr)


def layer_table(plan, profile=None) -> None:
    """A readable table of the engine's layers: type, tactic, output format, shape, origin count, time."""
    from kiln.trt.vocab import format_datatype, layer_type
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    times = {t.name: t for v in ("detailed", "layer_names_only") for t in profile.summary(v)} if profile else {}
    table = Table(title=Text(f"{plan.name}: {len(plan.layers)} layers"), show_lines=False)
    for col in ("#", "Layer", "Type", "Tactic", "Output", "Format/Datatype"):
        table.add_column(col, overflow="fold")
    if times:
        table.add_column("median ms", justify="right")
        table.add_column("%", justify="right")
    for i, layer in enumerate(plan.layers):
        rows = [(str(i), layer)] + [(f"  {i}.{j}", inner) for j, inner in enumerate(layer.inner)]
        for label, item in rows:
            out = item.outputs[0] if item.outputs else None
            name = item.name if item is layer else f"└ {item.name}"
            row = [label, name, layer_type(item), item.tactic_name,
                   "x".join(map(str, out.dims)) if out else "", format_datatype(out) if out else ""]
            if times:
                t = times.get(item.name)
                row += [f"{t.median_ms:.4f}" if t else "", f"{t.percentage:.1f}" if t else ""]
            table.add_row(*(Text(c) for c in row))   # plain text: layer names contain "[/...]"
    Console(width=200).print(table)


def record_table(info, profile, title: str) -> None:
    """A table of an inspected engine description (TensorRT or kiln), with times when a profile is given."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    times = {r.name: r for r in (profile or info.profile).records} if (profile or info.profile) else {}
    table = Table(title=Text(f"{title}: {len(info.layers)} layers ({info.source}, {info.verbosity})"))
    for col in ("#", "Layer", "Type", "Precision", "Tactic", "Output"):
        table.add_column(col, overflow="fold")
    if times:
        table.add_column("avg ms", justify="right")
    for i, layer in enumerate(info.layers):
        out = layer.outputs[0] if layer.outputs else None
        row = [str(i), layer.name, layer.layer_type or "", layer.precision or "", layer.tactic_name or "",
               "x".join(map(str, out.dims)) if out and out.dims else ""]
        if times:
            t = times.get(layer.name)
            row.append(f"{t.average_ms:.4f}" if t else "")
        table.add_row(*(Text(c) for c in row))
    Console(width=200).print(table)
    info_line = ", ".join(f"{k}: {v}" for k, v in sorted(info.layer_types.items()))
    print(f"Layer types: {info_line}")
    print("Precisions: " + ", ".join(f"{k}: {v}" for k, v in sorted(info.precisions.items())))
    for t in info.io_tensors:   # TensorRT 11's "I/O Tensors"
        ranges = "; ".join(f"profile {k}: " + " .. ".join("x".join(map(str, d)) for d in (p.min_dims, p.opt_dims,
                                                                                          p.max_dims) if d is not None)
                           for k, p in enumerate(t.profiles) if p.min_dims is not None)
        dims = "x".join(map(str, t.dims)) if t.dims is not None else "?"
        kind = t.precision or t.data_type or ""
        print(f"{t.io_mode or 'I/O'}: {t.name} {kind} {dims}" + (f" ({ranges})" if ranges else ""))
    for note in info.notes:
        print(f"Note: {note}")


def tuning_table(cache, title: str) -> None:
    """A TensorRT 11.1 tuning cache: one row per iteration (route, status, GPU time, accuracy loss per output), the
    best route within the accuracy budget marked, then the time/accuracy trade-off."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    best, front = cache.best(), {it.line for it in cache.trade_off()}
    budget = f", accuracy budget {cache.accuracy_algorithm or 'loss'} <= {cache.accuracy_threshold:g}" \
        if cache.accuracy_threshold is not None else ""
    table = Table(title=Text(f"{title}: {len(cache.iterations)} iterations ({cache.searching_algorithm or '?'} "
                             f"search{budget})"))
    for col in ("", "iter", "build route", "status", "GPU ms", *(f"loss {o}" for o in cache.outputs)):
        table.add_column(col, overflow="fold", justify="right" if col in ("iter", "GPU ms") else "left")
    for it in cache.iterations:
        mark = "best" if it is best else ("*" if it.line in front else "")
        status = cache.status(it) + (f": {it.error_message}" if it.error_message else "")
        losses = [f"{it.accuracy_loss[o]:.4g}" if it.accuracy_loss and o in it.accuracy_loss else ""
                  for o in cache.outputs]
        table.add_row(*(Text(c) for c in (mark, str(it.iteration), it.build_route or "(default)", status,
                                          f"{it.gpu_time_ms:.4f}" if it.gpu_time_ms is not None else "", *losses)))
    Console(width=200).print(table)
    if best is None:
        print("Best route: none (every route crashed, failed or exceeded the accuracy budget)")
        return
    print(f"Best route: iteration {best.iteration}, {best.gpu_time_ms:.4f} ms: {best.build_route or '(default)'}")
    default = next((it for it in cache.iterations if not it.build_route.strip() and it.gpu_time_ms), None)
    if default is not None and default is not best:
        print(f"  {default.gpu_time_ms / best.gpu_time_ms:.2f}x the default route's speed "
              f"({default.gpu_time_ms:.4f} ms, iteration {default.iteration})")
    front = sorted(cache.trade_off(), key=lambda it: it.gpu_time_ms)
    print("Trade-off (* and best: no other route is both faster and more accurate): " + ", ".join(
        f"iter {it.iteration} {it.gpu_time_ms:.4f} ms loss {it.max_accuracy_loss or 0:.4g}" for it in front))
