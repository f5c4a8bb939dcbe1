"""Atomic, checksummed files: temp file + fsync + rename, then fsync the directory."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to `path` atomically. With `mode` (e.g. 0o600) the file has exactly that
    mode from its creation on (the temp file is created with it), whatever the umask."""
    atomic_write_with(path, lambda f: f.write(data), mode=mode)


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], object], *, mode: int | None = None) -> None:
    """Like atomic_write_bytes, but `write(f)` streams the content into the temp file (e.g.
    `torch.save(obj, f)`), so no second copy of it is built in memory first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    with open(fd, "wb") as f:
        if mode is not None:  # a leftover temp file keeps its old mode through O_TRUNC; the umask may narrow it
            os.fchmod(f.fileno(), mode)
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def readable_by_others(path: str | os.PathLike, st: os.stat_result) -> str | None:
    """A secret file's problem in one line (its mode lets group or others in) and the fix, or None."""
    import stat

    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}"
    return None


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())
