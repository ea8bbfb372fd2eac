"""The verified kernel cache: compiled libraries in a folder private to the user, each with a record of the
sha256 kiln computed when it built it. A library is loaded only after its hash matches its record; one without a
record (planted) or with another hash (altered) is refused with a warning naming it, deleted, and built again."""
from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import Error
from kiln.fileio import atomic_write_text, cache_folder
from kiln.native.catalog import included_headers
from kiln.native.compiler import CompileError, Toolchain, compile_unit, sanitizing

log = logging.getLogger("kiln.native")

KEY_FORMAT = "kiln-kernel-key-1"
RECORD_FORMAT, RECORD_VERSION = "kiln-kernel-record", 1
NO_RECORD, CHANGED = "no record", "changed"


@functools.lru_cache(maxsize=None)
def folder() -> Path:
    """$KILN_CACHE_DIR/kernels (kernels-sanitized for sanitizer builds), private to the user; a fresh private
    temporary folder, removed at exit, where that cannot be used."""
    name = "kernels-sanitized" if sanitizing() else "kernels"
    try:
        found = cache_folder(name, private=True)
    except (Error, OSError) as exc:
        log.warning("%s; kernels are built in a private temporary folder instead", exc)
        found = None
    if found is None:
        found = Path(tempfile.mkdtemp(prefix="kiln-kernels-"))
        atexit.register(shutil.rmtree, found, ignore_errors=True)
    return found


def cache_key(name: str, unit: str, toolchain: Toolchain) -> str:
    """What a compiled library depends on: its source and every csrc header it includes, the compiler's path and
    version, the flags and libraries, and this CPU's ISA."""
    parts = [KEY_FORMAT, name, unit]
    for header, text in included_headers(unit):
        parts += [header, text]
    parts += [toolchain.compiler, toolchain.version, *toolchain.flags, "--", *toolchain.libs, toolchain.cpu]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Record:
    """What kiln wrote down when it built a library (the JSON file beside it)."""

    library: str          # the library's file name
    name: str             # its catalog name (gemm, winograd, pointwise, ...)
    sha256: str
    compiler: str
    compiler_version: str
    flags: tuple[str, ...]

    def to_json(self) -> str:
        doc = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "library": self.library, "name": self.name,
               "sha256": self.sha256, "compiler": self.compiler, "compiler_version": self.compiler_version,
               "flags": list(self.flags)}
        return json.dumps(doc, indent=1) + "\n"


def library_path(name: str, key: str) -> Path:
    return folder() / f"{name}-{key}.so"


def record_path(library: Path) -> Path:
    return library.with_suffix(".json")


def read_record(library: Path) -> Record | None:
    """The library's record, None when absent or not a record kiln wrote for this file."""
    try:
        doc = json.loads(record_path(library).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or doc.get("version") != RECORD_VERSION \
            or doc.get("library") != library.name:
        return None
    try:
        return Record(doc["library"], str(doc["name"]), str(doc["sha256"]), str(doc["compiler"]),
                      str(doc["compiler_version"]), tuple(str(f) for f in doc["flags"]))
    except (KeyError, TypeError):
        return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def problem_with(library: Path) -> str | None:
    """Why the cached `library` must not be loaded (NO_RECORD, or CHANGED with both hashes), None when its hash
    matches its record. Raises OSError where the library cannot be read."""
    record = read_record(library)
    if record is None:
        return NO_RECORD
    actual = sha256_of(library)
    return None if actual == record.sha256 else f"{CHANGED} (sha256 {actual[:16]}, recorded {record.sha256[:16]})"


def refusal(library: Path, problem: str) -> str:
    if problem == NO_RECORD:
        return f"kernel library {library} has no record of kiln building it (planted there?)"
    return f"kernel library {library} is not the one kiln built: {problem}"


@contextmanager
def _locked(library: Path):
    """Excludes other kiln processes from building or replacing this library meanwhile."""
    with open(library.parent / f".{library.stem}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(name: str, key: str, unit: str, toolchain: Toolchain) -> Path:
    """The verified library for (name, key): the cached one when its hash matches its record, else built now
    (temp file, record, rename). A refused library is deleted, with a warning naming it. Raises CompileError."""
    library = library_path(name, key)
    try:
        if problem_with(library) is None:
            return library
    except OSError:   # not built yet, or being replaced by another process
        pass
    with _locked(library):
        if library.is_file():   # checked again: another process may have built it meanwhile
            problem = problem_with(library)
            if problem is None:
                return library
            log.warning("%s: refused, deleted and built again", refusal(library, problem))
            library.unlink()
        _build(name, unit, toolchain, library)
    return library


def remove(library: Path) -> None:
    """Delete a library, its record and its self-check verdicts (kiln.native.selfcheck), excluding other kiln
    processes meanwhile."""
    with _locked(library):
        for path in (library, record_path(library), *library.parent.glob(f"{library.name}.selfcheck-*.json")):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _build(name: str, unit: str, toolchain: Toolchain, library: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{library.name}.", suffix=".tmp", dir=library.parent)
    os.close(fd)
    try:
        try:
            warnings = compile_unit(toolchain, unit, Path(tmp), library.with_suffix(".c").name)
        except CompileError as exc:
            raise CompileError(f"the C compiler rejected kernel library {library.name}: {exc}") from None
        if warnings:
            log.debug("kernel library %s built with compiler warnings:\n%s", library.name, warnings)
        record = Record(library.name, name, sha256_of(Path(tmp)), toolchain.compiler, toolchain.version,
                        toolchain.flags + toolchain.libs)
        atomic_write_text(record_path(library), record.to_json())   # the record first: a reader never sees the
        os.replace(tmp, library)                                     # library without it
        log.debug("kernel library %s built", library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cached_libraries() -> list[Path]:
    """Every library file in the cache folder, whoever put it there."""
    return sorted(p for p in folder().glob("*.so") if p.is_file())
