"""Benchmark runs as data: benchmarks/results/runs.csv, one row per run x model (columns: results/README.md).
compare.py appends a run's rows at its end; the file is read, extended and replaced whole (temp file + rename),
so an interrupted or failed write never leaves half a row."""
from __future__ import annotations

import csv
import io
import subprocess
from dataclasses import asdict, dataclass, fields
from pathlib import Path

RUNS_CSV = Path(__file__).resolve().parent / "results" / "runs.csv"


@dataclass(frozen=True)
class RunRow:
    """One model measured in one run. Times are medians in ms; ratios are kiln's median over the peer's; an empty
    field means not measured (no OpenVINO installed, torch eager on a Q/DQ model, an old run that kept no figure)."""

    run: str               # run id: a letter for the runs recorded by hand, a UTC timestamp for compare.py's
    date: str              # YYYY-MM-DD (UTC)
    cpu: str               # lscpu's model name
    isa: str               # the cpu_info.ISA_FLAGS present, space-separated
    threads: int
    model: str             # compare.py's model name: resnet18, resnet50, resnet18-int8, bert-base, yolov8n, ...
    kiln_ms: float | str
    onnxruntime_ms: float | str
    openvino_ms: float | str    # OpenVINO pinned to FP32 (INFERENCE_PRECISION_HINT=f32)
    openvino_default_ms: float | str   # OpenVINO at its default precision (bf16 on AVX512-BF16/AMX CPUs); bf16 runs
    torch_ms: float | str       # torch eager
    kiln_over_ort: float | str
    kiln_over_best: float | str  # best = the fastest peer (kiln's own FP32 engine of an INT8 model is no peer)
    kiln_over_bound: float | str  # bound = FLOPs / the fp32 peak measured at start-up (Winograd can go below 1)
    build_s: float | str
    load_s: float | str
    plan: str              # what kiln's engine ran: its layer types, or the one region it chose
    commit: str            # git describe of the code measured ("-dirty": uncommitted changes)
    notes: str


COLUMNS = tuple(f.name for f in fields(RunRow))


def git_commit(root: Path) -> str:
    """`git describe --always --dirty` of `root`, or '' outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def rows_csv(rows: list[RunRow], header: bool) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_cell(v) for v in asdict(row).values()])
    return out.getvalue()


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.2f}"
    return str(value)


def append_rows(rows: list[RunRow], path: Path = RUNS_CSV) -> None:
    """Append `rows` to the CSV at `path` (created with its header if missing): read, extend, write a temp file
    beside it, rename. A file whose header is not COLUMNS is refused, naming the file, before anything is written."""
    from kiln.fileio import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old:
        header = next(csv.reader([old.splitlines()[0]]), [])
        if tuple(header) != COLUMNS:
            raise SystemExit(f"{path}: header {','.join(header)!r} is not {','.join(COLUMNS)!r}; "
                             "fix the file or record elsewhere with --results-csv")
        if not old.endswith("\n"):
            old += "\n"
    atomic_write_text(path, old + rows_csv(rows, header=not old))
