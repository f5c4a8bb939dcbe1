"""The on-disk format of tier-2 checkpoints: paths, manifests, checksums, verified reads.

A rank's checkpoint of one step is a DCP directory `rank{r}.{token}.dcp/` plus the
manifest `rank{r}.json` that names and checksums every file in it; the manifest is
renamed into place last, so it is the commit point. The manifest is signed with the
job's key (`manifest_hmac`, HMAC-SHA256 over its canonical JSON), so the file checksums
it lists are authentic too. Everything tier 2 writes is private: files 0600, dirs 0700.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader

from unbroken.fsutil import fsync_dir  # noqa: F401 - re-exported for tier2.py
from torch.distributed.checkpoint.filesystem import FileSystem

FORMAT = "unbroken-tier2/2"
_UNSIGNED_FORMATS = ("unbroken-tier2/1",)  # plain sha256 manifests: anyone could rewrite them
_MIN_KEY_BYTES = 16
FILE_MODE, DIR_MODE = 0o600, 0o700
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_READ_CHUNK = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, incomplete or from another job; `path` names the file."""

    def __init__(self, message: str, path: str | os.PathLike) -> None:
        super().__init__(message)
        self.path = str(path)


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def manifest_path(directory: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(directory, step) / f"rank{rank}.json"


def list_steps(directory: str | os.PathLike) -> list[int]:
    """Steps that have a directory under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(steps)


def sha256_file(path: Path) -> tuple[str, int]:
    """Streamed sha256 and size; hashlib drops the GIL on large updates, so a writer thread
    hashing does not stall the training thread."""
    digest, size = hashlib.sha256(), 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return digest.hexdigest(), size


def check_key(key: object) -> bytes:
    """The job key, or ValueError naming the fix (a short or str key would sign nothing worth trusting)."""
    if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
        what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"key must be bytes of length >= {_MIN_KEY_BYTES} (the job key), got {what}; pass "
                         "unbroken.runtime.jobkey.read_job_key(run_dir)")
    return key


def manifest_hmac(doc: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 (job key) of a manifest's content (all keys but its own signature), independent of layout."""
    body = {k: v for k, v in doc.items() if k != "manifest_hmac"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def make_private_dir(path: Path) -> None:
    """Create `path` (parents as needed) as 0700; an existing directory is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)  # exactly 0700, whatever the umask


def remove_rank_entries(step_path: Path, rank: int, *, keep: tuple[str, ...] = ()) -> None:
    """Delete this rank's files in a step directory (manifest first, so the step stops counting
    as written before its data goes), sparing the names in `keep`."""
    manifest = step_path / f"rank{rank}.json"
    if manifest.name not in keep:
        manifest.unlink(missing_ok=True)
    prefixes = (f"rank{rank}.", f".rank{rank}.")  # "rank1." never matches rank10's files
    for entry in list(step_path.iterdir()) if step_path.is_dir() else []:
        if entry.name in keep or not entry.name.startswith(prefixes):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _fail(path: Path, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path}: {what}; {fix}", path)


def read_manifest(directory: str | os.PathLike, step: int, *, rank: int, world_size: int,
                  run_id: str, key: bytes) -> dict[str, Any]:
    """Parse and check one rank's manifest: format, its signature (job key), run, world size, rank, step."""
    path = manifest_path(directory, step, rank)
    skip = "this step cannot be used; resume from an older step (latest_valid_step) or delete it"
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise _fail(path, f"missing: rank {rank} never finished writing step {step}", skip) from None
    except (OSError, ValueError) as e:
        raise _fail(path, f"unreadable or truncated manifest ({e})", skip) from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt in _UNSIGNED_FORMATS:
        raise _fail(path, f"format {fmt!r} (unsigned manifests), this version reads only signed {FORMAT!r}",
                    "export or resume it with the unbroken version that wrote it, or delete the step")
    if fmt != FORMAT:
        raise _fail(path, f"format {fmt!r}, this version reads {FORMAT!r}", skip)
    signature = doc.get("manifest_hmac")
    if not isinstance(signature, str) or not hmac.compare_digest(signature, manifest_hmac(doc, key)):
        raise _fail(path, "manifest signature mismatch: tampered, or written by another job/key",
                    "use the job.key of the run that wrote it, or resume from an older step or delete it")
    if doc["run_id"] != run_id:
        raise _fail(path, f"belongs to run {doc['run_id']!r}, not {run_id!r}",
                    "point the job at its own checkpoint directory, or pass the matching run_id")
    if doc["world_size"] != world_size:
        raise _fail(path, f"written by a job of world size {doc['world_size']}, this job has {world_size}",
                    "restart with the original world size or start from scratch")
    if doc["rank"] != rank or doc["step"] != step:
        raise _fail(path, f"says rank {doc['rank']} step {doc['step']}, expected rank {rank} step {step}",
                    "the file was moved or copied by hand; restore it or delete the step")
    return doc


def _file_entries(step_path: Path, manifest: dict[str, Any]) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    prefix = manifest["data_dir"] + "/"
    for rel, entry in sorted(manifest["files"].items()):
        if not rel.startswith(prefix) or ".." in Path(rel).parts or Path(rel).is_absolute():
            raise _fail(step_path / rel, "manifest names a file outside its data directory",
                        "the manifest was edited by hand; delete the step")
        yield rel, step_path / rel, entry


def verify_files(step_path: Path, manifest: dict[str, Any], *, keep_bytes: bool) -> dict[str, bytes]:
    """Check every file the manifest lists (size, then sha256). With keep_bytes, return the
    verified bytes so the caller deserializes exactly what was checked, not a re-read."""
    blobs: dict[str, bytes] = {}
    fix = "this step cannot be used; resume from an older step (latest_valid_step) or delete it"
    for rel, path, entry in _file_entries(step_path, manifest):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _fail(path, "missing", fix) from None
        if size != entry["bytes"]:
            raise _fail(path, f"{size} bytes, manifest says {entry['bytes']} (truncated)", fix)
        if keep_bytes:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            blobs[rel] = data
        else:
            digest, _ = sha256_file(path)
        if digest != entry["sha256"]:
            raise _fail(path, "sha256 mismatch (corrupted)", fix)
    return blobs


def parse_dtype(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise _fail(path, f"unknown dtype {name!r}", "it was written by a newer torch; upgrade torch")
    return dtype


class _VerifiedFS(FileSystem):
    """A read-only DCP filesystem serving only bytes that were checksummed already."""

    def __init__(self, root: Path, blobs: dict[str, bytes]) -> None:
        super().__init__()
        self.root, self.blobs = root, blobs

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        assert mode == "rb", f"verified checkpoint reads are read-only, got mode {mode!r}"
        rel = Path(path).relative_to(self.root.parent).as_posix()
        if rel not in self.blobs:
            raise _fail(Path(path), "not covered by the manifest's checksums",
                        "the DCP directory was altered; delete the step")
        yield io.BytesIO(self.blobs[rel])


class VerifiedReader(FileSystemReader):
    """DCP's FileSystemReader, reading from verified in-memory bytes instead of the disk."""

    def __init__(self, data_dir: Path, blobs: dict[str, bytes]) -> None:
        super().__init__(data_dir)
        self.fs = _VerifiedFS(Path(data_dir), blobs)
