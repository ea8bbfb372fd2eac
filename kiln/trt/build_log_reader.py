"""Read a trtexec / TensorRT (7, 8.x, 10.x) or kiln --verbose build log into a `BuildLog`.

Every line may carry a logger prefix: "[MM/DD/YYYY-HH:MM:SS] [V] [TRT] " (or [I]/[W]/[E]/[F], with or without
"[TRT]" / "[kiln]"), or the python logger's "[TensorRT] VERBOSE: ". The prefix is stripped, then the message is
matched against the forms TensorRT prints (their patterns, beside kiln's writers of the same lines, are in
`kiln.trt.build_log`): option/device/performance sections ("=== Build Options ===" + "key: value"), graph-optimizer
lines ("Running: <Pass> on <layer>", "<Pass>: Fusing <A> with <B>", "Removing <x>", ...), the layer count trajectory
("Original: N layers", "After <what>: N layers"), autotuning lines ("Timing Runner", "Tactic: ... Time:", "Chose
Runner Type") and memory lines. Lines that match nothing are skipped; a line that cannot be read never stops
the parse. Timing tuples are (layer, tactic, ms) where layer is "<layer> (<runner>)" as the Timing Runner line printed
it and tactic is the tactic name when the log prints one ("Tactic Name: ..."), else the value as printed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import ArtifactError
from kiln.trt import build_log as log_lines
from kiln.trt.readers import read_oneline
from kiln.trt.records import BuildLog, PassEvent, TacticChoice


@dataclass
class _State:
    """What has been read so far; turned into a frozen BuildLog at the end."""

    version: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    device: dict[str, str] = field(default_factory=dict)
    performance: dict[str, str] = field(default_factory=dict)
    memory: dict[str, str] = field(default_factory=dict)
    events: list[PassEvent] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    trajectory: list[tuple[str, int]] = field(default_factory=list)
    choices: list[TacticChoice] = field(default_factory=list)
    timings: list[tuple[str, str, float]] = field(default_factory=list)
    section: str | None = None
    current_pass: str | None = None
    layer: str | None = None
    runner: str | None = None
    runner_times: dict[tuple[str, str], float] = field(default_factory=dict)
    engine_dump: dict[str, int] = field(default_factory=dict)
    recognized: int = 0
    prefixed: int = 0
    non_ascii: int = 0
    warnings: list[str] = field(default_factory=list)


def strip_prefix(line: str) -> tuple[str, bool]:
    """Remove the logger prefix; returns (message, whether a prefix was found)."""
    msg, found = line.rstrip("\r\n").lstrip("\ufeff"), False
    for rx in (log_lines.PREFIX_DATE, log_lines.PREFIX_LEVEL, log_lines.PREFIX_TAG):
        m = rx.match(msg)
        if m:
            msg, found = msg[m.end():], True
    m = log_lines.PREFIX_PYTHON.match(msg)
    if m:
        msg, found = msg[m.end():], True
    return msg.rstrip(), found


def _check_text(text: str | bytes, where: str) -> str:
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ArtifactError(f"{where}: expected the text of a build log, got {type(text).__name__}")
    if not text.strip():
        raise ArtifactError(f"{where}: the build log is empty; hint: capture trtexec/kiln output with --verbose")
    sample = text[:65536]
    bad = sum(1 for ch in sample if (ord(ch) < 32 and ch not in "\t\r\n\f\v") or ch == "\ufffd")
    if "\x00" in sample or bad > max(8, len(sample) // 100):
        raise ArtifactError(f"{where}: this looks like a binary file, not a text build log; "
                            "hint: pass the --verbose console output of trtexec or `kiln build`, not an engine")
    return text


def _section_line(st: _State, msg: str) -> bool:
    """Header lines and key: value lines inside a known section."""
    m = log_lines.SECTION_HEADER.match(msg.strip())
    if m:
        st.section = log_lines.SECTIONS.get(m.group(1))
        return True
    if st.section is None:
        return False
    if not msg.strip() or msg.startswith("&&&&"):
        st.section = None
        return True
    if st.section == "performance" and msg.lstrip().startswith("*"):
        st.warnings.append(msg.strip())
        return True
    kv = log_lines.SECTION_KEY_VALUE.match(msg)
    if not kv:
        if st.section == "performance" and msg.startswith("  ") and st.warnings:
            st.warnings[-1] += " " + msg.strip()
            return True
        st.section = None
        return False
    key, value = kv.group(1).strip(), kv.group(2).strip()
    if key == "TensorRT version":
        return False
    getattr(st, st.section)[key] = value
    return True


def _version_line(st: _State, msg: str) -> bool:
    for rx, fmt in log_lines.VERSIONS:
        m = rx.search(msg)
        if not m:
            continue
        if fmt is None:
            n = int(m.group(1))
            major, minor = (n // 10000, n // 100 % 100) if n >= 10000 else (n // 1000, n // 100 % 10)
            value = f"TensorRT {major}.{minor}.{n % 100}"
        else:
            value = fmt.format(m.group(1))
        st.version = st.version or value
        return True
    return False


def _event(st: _State, pass_name: str | None, kind: str, *subjects: str) -> bool:
    st.events.append(PassEvent(pass_name or "", kind, tuple(s.strip() for s in subjects)))
    return True


def _pass_line(st: _State, msg: str) -> bool:
    """Graph-optimizer lines; returns True when the line was one."""
    m = log_lines.RUNNING.match(msg)
    if m:
        st.current_pass = m.group(1)
        st.running[m.group(1)] = st.running.get(m.group(1), 0) + 1
        return _event(st, m.group(1), "running", m.group(2))
    for rx, kind in ((log_lines.NOT_FUSING, "not_fused"), (log_lines.FUSING, "fusing"),
                     (log_lines.QDIN_PAIR, "fusing"), (log_lines.QDIN, "fusing")):
        m = rx.match(msg)
        if m:
            return _event(st, m.group(1), kind, *m.groups()[1:])
    for rx, kind in ((log_lines.REMOVING, "removing"), (log_lines.SWAPPING, "swapping"),
                     (log_lines.DUPLICATE, "eliminating")):
        m = rx.match(msg)
        if m:
            subjects = m.groups() if kind != "eliminating" else (m.group(1), m.group(3))
            return _event(st, st.current_pass, kind, *subjects)
    m = log_lines.SWAP_TYPE.match(msg)
    if m:
        return _event(st, st.current_pass, "swap_type", *[g for g in m.groups() if g is not None])
    for rx, name, kind in ((log_lines.SLICE, "slice removal", "eliminating_slice"),
                           (log_lines.CONCAT, "concat removal", "eliminating_concat"),
                           (log_lines.NOT_CONCAT, "concat removal", "not_eliminating_concat"),
                           (log_lines.RETARGETING, "concat removal", "retargeting"),
                           (log_lines.GENERATING_COPY, "concat removal", "generating_copy")):
        m = rx.match(msg)
        if m:
            return _event(st, name, kind, *m.groups())
    m = log_lines.MERGING.match(msg)
    if m:
        return _event(st, "horizontal merge", "merging", *m.group(1).split(" || "))
    m = log_lines.SKIPPING.match(msg)
    if m:
        return _event(st, m.group(1), "skipped")
    m = log_lines.PASS_NOTE.match(msg)
    if m and m.group(1) in st.running:
        return _event(st, m.group(1), "note", m.group(2))
    return False


def _trajectory_line(st: _State, msg: str) -> bool:
    m = log_lines.ORIGINAL.match(msg)
    if m:
        st.trajectory.append(("Original", int(m.group(1))))
        return True
    m = log_lines.AFTER.match(msg)
    if m:
        st.trajectory.append((f"After {m.group(1)}", int(m.group(2))))
        st.current_pass = None
        return True
    return False


def _bare_runner(runner: str | None) -> str | None:
    return runner.split("[", 1)[0] if runner else runner


def _tactic_line(st: _State, msg: str) -> bool:
    m = log_lines.COMPUTING_COSTS.match(msg)
    if m:
        st.layer, st.runner = m.group(1), None
        return True
    m = log_lines.TIMING_RUNNER.match(msg)
    if m:
        st.layer, st.runner = m.group(1), m.group(2)
        return True
    m = log_lines.TACTIC_TIME.match(msg)
    if m:
        name, value, time_ms = m.group(1), m.group(2), float(m.group(3))
        where = f"{st.layer} ({st.runner})" if st.runner else (st.layer or "")
        st.timings.append((where, name or value, time_ms))
        st.runner_times.setdefault((f"{st.layer}|{_bare_runner(st.runner)}", value), time_ms)
        return True
    m = log_lines.CHOSE_RUNNER.match(msg)
    if m:
        runner, value = m.group(1), m.group(2)
        time_ms = st.runner_times.get((f"{st.layer}|{_bare_runner(runner)}", value))
        st.choices.append(TacticChoice(st.layer or "", runner, value, time_ms))
        return True
    m = log_lines.FASTEST_TACTIC.search(msg)
    if m:
        st.runner_times[(f"{st.layer}|{_bare_runner(st.runner)}", m.group(1))] = float(m.group(2))
        return True
    return False


def _memory_line(st: _State, msg: str) -> bool:
    m = log_lines.MEMORY_CHANGE.match(msg)
    if m:
        key = f"MemUsageChange {m.group(1)}"
        n = 2
        while key in st.memory:
            key, n = f"MemUsageChange {m.group(1)} #{n}", n + 1
        st.memory[key] = m.group(2)
        return True
    for rx in log_lines.MEMORY:
        m = rx.match(msg)
        if m:
            st.memory[m.group(1)] = m.group(2).strip()
            return True
    return False


def _engine_line(st: _State, msg: str) -> bool:
    for rx, key in ((log_lines.ENGINE_LAYER, "Layer(...)"), (log_lines.ONELINE_LAYER, "Name: ...")):
        if rx.match(msg):
            st.engine_dump[key] = st.engine_dump.get(key, 0) + 1
            return True
    return msg in log_lines.LAYER_DUMP_HEADERS


def _read_line(st: _State, line: str) -> None:
    msg, prefixed = strip_prefix(line)
    st.prefixed += prefixed
    if not msg.isascii():
        st.non_ascii += 1
    try:
        for reader in (_section_line, _version_line, _trajectory_line, _pass_line, _tactic_line,
                       _memory_line, _engine_line):
            if reader(st, msg):
                st.recognized += 1
                return
    except (ValueError, IndexError, OverflowError):   # a malformed number: skip the line, keep going
        return


def _pass_counts(st: _State) -> dict[str, int]:
    counts = dict(st.running)
    for e in st.events:
        if e.kind == "fusing" and e.pass_name not in st.running:
            counts[e.pass_name] = counts.get(e.pass_name, 0) + 1
    return counts


def _notes(st: _State) -> list[str]:
    notes = []
    if not any(e.kind in ("running", "fusing") for e in st.events) and not st.trajectory:
        notes.append("log contains no pass lines; was it built with --verbose?")
    if st.non_ascii:
        notes.append(f"{st.non_ascii} line(s) contain non-ASCII text (translated or corrupted?); "
                     "those not in TensorRT's own wording were skipped")
    for key, n in st.engine_dump.items():
        notes.append(f"engine layer dump present: {n} '{key}' line(s)")
    if st.events and not st.choices and not st.timings:
        notes.append("no autotuning lines (Timing Runner / Chose Runner Type) found")
    notes.extend(f"performance warning: {w.lstrip('* ')}" for w in st.warnings)
    return notes


def parse_build_log(text: str | bytes, where: str = "<log>") -> BuildLog:
    """Parse the text of a verbose build log; `where` names the file in error messages."""
    text = _check_text(text, where)
    st = _State()
    for line in text.splitlines():
        _read_line(st, line)
    if st.recognized == 0 and st.prefixed == 0:
        raise ArtifactError(f"{where}: no TensorRT or kiln log lines found; hint: pass the console output of "
                            "`trtexec --verbose` or `kiln build --verbose` (lines like '[V] [TRT] Original: 32 layers')")
    return BuildLog(tool_version=st.version, options=st.options, device=st.device, events=tuple(st.events),
                    pass_counts=_pass_counts(st), layer_trajectory=tuple(st.trajectory),
                    tactic_choices=tuple(st.choices), timings=tuple(st.timings), memory=st.memory,
                    performance=st.performance, engine=_engine_dump(text, where, st), notes=tuple(_notes(st)))


def _engine_dump(text: str, where: str, st: _State):
    """The layer dump inside the log ("Layers:" / "Engine Layer Information:"), read by the one-line reader."""
    if not st.engine_dump:
        return None
    try:
        return read_oneline(text, where)
    except ArtifactError:
        return None
