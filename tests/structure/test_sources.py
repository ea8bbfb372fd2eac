"""Source hygiene: no half-resolved merge left in any tracked text file (a stray `<<<<<<< HEAD` once reached
`kiln inspect --help` through a module docstring)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".c", ".h", ".md", ".toml", ".cfg", ".txt", ".yml", ".yaml", ".json", ".sh", ".csv"}
MARKER = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.MULTILINE)   # git's conflict lines, not longer runs


def tracked_text_files() -> list[Path]:
    """The repository's tracked text files (every text file under the root where git is missing)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = [ROOT / line for line in listed.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in ("Makefile", "run"))]


def conflict_lines(text: str) -> list[int]:
    """1-based numbers of the lines that are merge-conflict markers."""
    return [text.count("\n", 0, m.start()) + 1 for m in MARKER.finditer(text)]


def test_the_check_finds_markers_and_spares_long_runs():
    merged = "a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> topic\n"
    assert conflict_lines(merged) == [2, 4, 6]
    assert conflict_lines(">>>>>>>>>>>>>>> Chose Runner Type: CaskConvolution\n=========\n") == []


def test_no_merge_conflict_markers():
    files = tracked_text_files()
    assert len(files) > 100, "the tracked files were not found"
    found = {str(p.relative_to(ROOT)): lines for p in files if (lines := conflict_lines(p.read_text(errors="replace")))}
    assert not found, f"merge-conflict markers (file: line numbers): {found}"
