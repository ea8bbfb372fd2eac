"""Atomic file writes (a temp file beside the target, fsync, rename: readers never see half a file) and kiln's
cache folders."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kiln.errors import Error


def atomic_write_bytes(path: str | os.PathLike, chunks: list[bytes]) -> None:
    """Write to a temp file beside `path`, fsync, then rename: readers never see a half-written file."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise Error(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes 0600 files; give the permissions a plain write would
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise Error(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, [text.encode("utf-8")])


def cache_folder(name: str, private: bool = False) -> Path | None:
    """kiln's cache folder `name` under $KILN_CACHE_DIR (default ~/.cache/kiln), created if needed; None when
    KILN_CACHE_DIR=off or the folder cannot be created or written. `private`: created 0700 (an existing one of
    this user's is narrowed to 0700), and an Error names the folder when another user owns it or group or
    others may write it: whatever is cached there must come from this user alone."""
    root = os.environ.get("KILN_CACHE_DIR", str(Path.home() / ".cache" / "kiln"))
    if root.lower() in ("off", "0", "none", ""):
        return None
    folder = Path(root) / name
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    except OSError:
        return None
    if private:
        _make_private(folder)
    return folder if os.access(folder, os.W_OK) else None


def _make_private(folder: Path) -> None:
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise Error(f"cache folder {folder} belongs to another user (uid {info.st_uid}), so kiln does not use it; "
                    "remove it or point KILN_CACHE_DIR to a folder of your own")
    if info.st_mode & 0o022:
        raise Error(f"cache folder {folder} is writable by group or others (mode {info.st_mode & 0o777:o}), so kiln "
                    f"does not use it; check its contents, then chmod 700 {folder}")
    if info.st_mode & 0o777 != 0o700:
        os.chmod(folder, 0o700)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
