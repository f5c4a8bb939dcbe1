"""The job's secret key: what tier-2 manifests are signed with (HMAC-SHA256).

It lives in RUN_DIR/job.key (mode 0600, 32 bytes as hex). With a join token every node
derives the same key from the token, so nodes with separate run directories agree;
without one, node 0 draws a random key and nodes sharing the run directory read it.
The key never travels through the store or a process's environment: workers read the
file. `unbroken run --resume` and `unbroken export` read it from the run directory.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from unbroken.fsutil import readable_by_others

KEY_FILE = "job.key"


class JobKeyError(ValueError):
    """The key file is missing, malformed or readable by others."""


def derive_from_token(token: str) -> bytes:
    return hmac.new(token.encode(), b"unbroken tier-2 manifest key", hashlib.sha256).digest()


def ensure_job_key(run_dir: Path, token: str | None = None) -> bytes:
    """The run directory's key, created (atomically, 0600) if it has none yet."""
    path = Path(run_dir) / KEY_FILE
    if path.exists():
        return read_job_key(run_dir)
    key = derive_from_token(token) if token else secrets.token_bytes(32)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.hex().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another node created it first: theirs wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_job_key(run_dir)


def read_job_key(run_dir: Path) -> bytes:
    """Read and check RUN_DIR/job.key; a one-line JobKeyError names the problem and the fix."""
    path = Path(run_dir) / KEY_FILE
    try:
        st = path.stat()
        text = path.read_text().strip()
    except FileNotFoundError:
        raise JobKeyError(f"{path} is missing: this run directory was not written by this version of "
                          "unbroken (or the file was deleted); its checkpoints cannot be trusted") from None
    if problem := readable_by_others(path, st):
        raise JobKeyError(problem)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise JobKeyError(f"{path} does not hold a 32-byte hex key; restore it from a backup")
    return key
