"""Tier 2: asynchronous persistent checkpoints, atomic and checksummed, one DCP directory per rank.

The training thread only starts copying tensors into preallocated host buffers (from a
GPU: pinned, async on a side stream, protect/staging.py); a background thread waits for the
copy and writes them with `torch.distributed.checkpoint` and commits a checksummed manifest.
no_dist=True is what makes DCP safe off the training thread: without it DCP plans the
save with gather/scatter collectives from the calling thread (checked in the tests). Layout:

    directory/step_00000120/rank0.json                  manifest: the commit point
    directory/step_00000120/rank0.g3-1a2b3c4d.dcp/      a standalone DCP checkpoint

Each rank directory loads with plain `dcp.load(sd, checkpoint_id=..., no_dist=True)`;
`load_checkpoint` does the same but only from bytes whose sha256 it has just verified,
listed in a manifest whose HMAC (the job's key) it has just verified. Retention never
deletes the step `pin`ned as the newest one every rank committed; `step_mask` and
`newest_in_mask` are how the ranks learn it (one bitwise-AND all-reduce per checkpoint).
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from unbroken.fsutil import atomic_write_bytes
from unbroken.protect.staging import HostStaging
from unbroken.protect._tier2_files import (DIR_MODE, FILE_MODE, FORMAT, CheckpointError, VerifiedReader,
                                           check_key, fsync_dir, list_steps, make_private_dir, manifest_hmac,
                                           manifest_path, parse_dtype, read_manifest, remove_rank_entries,
                                           sha256_file, step_dir, verify_files)

if TYPE_CHECKING:
    from unbroken.events import EventLog

__all__ = ["CheckpointError", "CheckpointWriteError", "CheckpointWriter", "MASK_SLOTS", "latest_valid_step",
           "load_checkpoint", "newest_in_mask", "newest_own_valid_step", "step_mask", "verify_step"]

MASK_SLOTS = 63  # checkpoint slots a committed-steps mask covers: bits 0..62 of an int64, never its sign

# no_dist is deliberate here (each rank writes its own standalone checkpoint), so DCP's
# "assuming the intent is to save in a single process" warning is noise. A process-wide
# filter because warnings.catch_warnings is not thread-safe and the save runs in a thread.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed (disk full, permissions...); the cause is chained."""


class CheckpointWriter:
    """Writes one rank's checkpoints in a background thread from preallocated snapshot buffers."""

    def __init__(self, directory: str | os.PathLike, *, rank: int, world_size: int, run_id: str,
                 strategy: str, key: bytes, keep: int = 2, events: "EventLog | None" = None,
                 wait_timeout: float = 60.0) -> None:
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"keep must be an integer >= 1 (checkpoints retained per rank), got {keep!r}")
        if not (isinstance(run_id, str) and run_id):
            raise ValueError(f"run_id must be a non-empty string naming the job, got {run_id!r}")
        if wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be > 0 seconds, got {wait_timeout!r}")
        self._key = check_key(key)
        self.directory = Path(directory)
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.strategy, self.keep, self.events, self.wait_timeout = str(strategy), keep, events, wait_timeout
        self._buffers: dict[str, torch.Tensor] = {}
        self._staging = HostStaging()
        self._thread: threading.Thread | None = None
        self._inflight: int | None = None
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self.last_snapshot_s = 0.0  # how long save_async held the training thread
        self.last_save_s = 0.0  # snapshot start -> manifest committed
        self.last_path: Path | None = None
        self._lock = threading.Lock()  # guards _committed and _pinned (the writer thread changes them)
        self._pinned: int | None = None
        # what this rank has committed: a replacement process inherits its predecessor's files
        self._committed = {s for s in list_steps(self.directory)
                           if manifest_path(self.directory, s, rank).exists()}

    def committed_steps(self) -> frozenset[int]:
        """The steps whose files this rank has committed and retention has not removed (no disk access)."""
        with self._lock:
            return frozenset(self._committed)

    @property
    def pinned(self) -> int | None:
        """The step retention spares (see `pin`), if any."""
        with self._lock:
            return self._pinned

    def pin(self, step: int) -> None:
        """Retention never deletes this rank's files of `step` (the newest step every rank committed),
        until another step is pinned."""
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"pin takes a committed step >= 0, got {step!r}")
        with self._lock:
            self._pinned = step

    def save_async(self, step: int, generation: int, tensors: dict[str, torch.Tensor],
                   meta: dict | None = None) -> None:
        """Copy tensors into preallocated buffers now (allocated on first call, reused after;
        if a previous write is still running, wait for it first with a timeout), write in a
        background thread."""
        if self._closed:
            raise RuntimeError(f"CheckpointWriter for rank {self.rank} is closed; create a new one")
        _check_save_args(step, generation, tensors, meta)
        self.wait(self.wait_timeout)  # its buffers are about to be overwritten
        start = time.perf_counter()
        self._snapshot(tensors)
        self.last_snapshot_s = time.perf_counter() - start
        self._inflight = step
        self._thread = threading.Thread(
            target=self._run, args=(step, generation, dict(meta or {}), start),
            name=f"unbroken-tier2-rank{self.rank}-step{step}", daemon=True)
        self._thread.start()

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> None:
        self._staging.copy(tensors)  # from a GPU the copy is still in flight: _run waits for it
        self._buffers = self._staging.buffers

    def _run(self, step: int, generation: int, meta: dict, start: float) -> None:
        try:
            self._staging.ready(self.wait_timeout)
            path, nbytes = self._write(step, generation, meta)
            with self._lock:
                self._committed.add(step)
            self._retain()
            self.last_save_s, self.last_path = time.perf_counter() - start, path
            if self.events is not None:
                self.events.emit("checkpoint_saved", step=step, path=str(path), bytes=nbytes,
                                 save_s=round(self.last_save_s, 6))
        except BaseException as e:  # surfaced to the training thread by wait()
            self._error = (step, e)

    def _write(self, step: int, generation: int, meta: dict) -> tuple[Path, int]:
        """DCP into a temp dir, checksum, rename it into place, then commit the signed manifest."""
        sdir = step_dir(self.directory, step)
        make_private_dir(self.directory)
        make_private_dir(sdir)
        name = f"rank{self.rank}.g{generation}-{uuid.uuid4().hex[:8]}.dcp"
        tmp = sdir / f"{name}.tmp"
        make_private_dir(tmp)  # 0700 before DCP writes: its files are never reachable by others
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        dcp.save(self._buffers, storage_writer=writer, no_dist=True)
        os.chmod(tmp, DIR_MODE)
        files = {}
        for f in sorted(tmp.iterdir()):
            os.chmod(f, FILE_MODE)  # before hashing: what is checksummed is what stays private
            digest, size = sha256_file(f)
            files[f"{name}/{f.name}"] = {"sha256": digest, "bytes": size}
        fsync_dir(tmp)
        os.rename(tmp, sdir / name)
        fsync_dir(sdir)
        doc = {"format": FORMAT, "step": step, "generation": generation, "world_size": self.world_size,
               "rank": self.rank, "strategy": self.strategy, "run_id": self.run_id,
               "written_at": time.time(), "data_dir": name, "files": files, "meta": meta,
               "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape)}
                           for k, v in self._buffers.items()}}
        doc["manifest_hmac"] = manifest_hmac(doc, self._key)
        body = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        manifest = manifest_path(self.directory, step, self.rank)
        atomic_write_bytes(manifest, body, mode=FILE_MODE)
        # Earlier attempts at this step (a crash, a re-save after rollback) are now unreferenced.
        remove_rank_entries(sdir, self.rank, keep=(manifest.name, name))
        return manifest, len(body) + sum(f["bytes"] for f in files.values())

    def _retain(self) -> None:
        """Drop this rank's files of steps older than the `keep` newest this rank committed,
        except the pinned step (the newest every rank committed: a rank lagging behind must not
        leave the job without a common checkpoint). Other ranks may still be writing newer
        steps, so only older ones are touched."""
        mine = [s for s in list_steps(self.directory)
                if manifest_path(self.directory, s, self.rank).exists()]
        if len(mine) <= self.keep:
            return
        oldest_kept = mine[-self.keep]
        pinned = self.pinned
        for s in list_steps(self.directory):
            if s >= oldest_kept:
                break
            if s == pinned:
                continue
            sdir = step_dir(self.directory, s)
            remove_rank_entries(sdir, self.rank)
            with self._lock:
                self._committed.discard(s)
            try:
                sdir.rmdir()  # only succeeds once every rank's files are gone
            except OSError:
                pass

    def wait(self, timeout: float = 60.0) -> None:
        """Block until the write in flight is committed; raise TimeoutError naming the step if not."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"rank {self.rank}: checkpoint of step {self._inflight} still writing to "
                    f"{step_dir(self.directory, self._inflight)} after {timeout:.1f}s; the disk is slow "
                    "or hung (check free space and I/O), or raise the timeout")
            self._thread = self._inflight = None
        if self._error is not None:
            step, err = self._error
            self._error = None
            raise CheckpointWriteError(
                f"rank {self.rank}: writing checkpoint step {step} under {self.directory} failed: "
                f"{type(err).__name__}: {err}") from err

    def close(self, timeout: float = 60.0) -> None:
        """Finish the write in flight and free the snapshot buffers; idempotent."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            if self._thread is None:
                self._closed = True
                self._buffers, self._staging = {}, HostStaging()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(self.wait_timeout)


def _check_save_args(step: int, generation: int, tensors: dict[str, torch.Tensor], meta: dict | None) -> None:
    if not (isinstance(step, int) and step >= 0):
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not (isinstance(generation, int) and generation >= 0):
        raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("tensors must be a non-empty dict of name -> torch.Tensor")
    for name, t in tensors.items():
        if not (isinstance(name, str) and name) or not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors must map non-empty str names to torch.Tensor, got "
                             f"{name!r}: {type(t).__name__}")
    try:
        json.dumps(meta or {})
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable (it goes into the manifest): {e}") from None


def step_mask(steps: "set[int] | frozenset[int]", newest: int, every: int) -> int:
    """Bit k (k < MASK_SLOTS) set when step `newest - k*every` is in `steps`: the ranks AND their
    masks to learn which recent checkpoint slots every one of them committed."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every must be the checkpoint interval, an integer >= 1, got {every!r}")
    mask = 0
    for k in range(MASK_SLOTS):
        if newest - k * every < 0:
            break
        if newest - k * every in steps:
            mask |= 1 << k
    return mask


def newest_in_mask(mask: int, newest: int, every: int) -> int | None:
    """The newest step a `step_mask` (or the AND of several) holds; None when it holds none."""
    if mask <= 0:
        return None
    return newest - ((mask & -mask).bit_length() - 1) * every


def verify_step(directory: str | os.PathLike, step: int, *, world_size: int, run_id: str, key: bytes) -> None:
    """Check every rank's manifest (signature included) and every file's sha256; raise
    CheckpointError naming the first bad file."""
    check_key(key)
    for rank in range(world_size):
        doc = read_manifest(directory, step, rank=rank, world_size=world_size, run_id=run_id, key=key)
        verify_files(step_dir(directory, step), doc, keep_bytes=False)


def _skip(step: int, e: CheckpointError, events: "EventLog | None") -> None:
    if events is not None:
        events.emit("checkpoint_invalid", path=e.path, error=str(e))
    warnings.warn(f"skipping checkpoint step {step}: {e}", stacklevel=3)


def latest_valid_step(directory: str | os.PathLike, *, world_size: int, run_id: str, key: bytes,
                      events: "EventLog | None" = None) -> int | None:
    """Newest step whose files exist for ALL ranks and verify (signatures, checksums); corrupted,
    foreign or incomplete ones are skipped with a `checkpoint_invalid` event (if events given) and a
    warning naming the file. Reads every rank's files: a whole-job check (export); a running job
    agrees with `newest_own_valid_step` instead."""
    check_key(key)
    for step in reversed(list_steps(directory)):
        try:
            verify_step(directory, step, world_size=world_size, run_id=run_id, key=key)
            return step
        except CheckpointError as e:
            _skip(step, e, events)
    return None


def newest_signed_step(directory: str | os.PathLike, *, world_size: int, run_id: str, key: bytes) -> int | None:
    """Newest step whose manifests of ALL ranks are present and signed with `key` (the data
    files are not read: the cheap look before a resume; the ranks then verify their own)."""
    check_key(key)
    for step in reversed(list_steps(directory)):
        try:
            for rank in range(world_size):
                read_manifest(directory, step, rank=rank, world_size=world_size, run_id=run_id, key=key)
            return step
        except CheckpointError:
            continue
    return None


def newest_own_valid_step(directory: str | os.PathLike, *, rank: int, world_size: int, run_id: str, key: bytes,
                          at_most: int | None = None, cache: dict[int, bool] | None = None,
                          events: "EventLog | None" = None) -> int | None:
    """Newest step <= at_most (None: any) whose files of THIS rank verify, or None. Each rank
    checks only its own files; the ranks then agree by voting (runtime/recovery.py). `cache`
    (step -> valid) lets repeated calls check each step once; a bad step is reported (event,
    warning) only when first checked."""
    check_key(key)
    cache = {} if cache is None else cache
    for step in reversed(list_steps(directory)):
        if at_most is not None and step > at_most:
            continue
        if step not in cache:
            try:
                doc = read_manifest(directory, step, rank=rank, world_size=world_size, run_id=run_id, key=key)
                verify_files(step_dir(directory, step), doc, keep_bytes=False)
                cache[step] = True
            except CheckpointError as e:
                cache[step] = False
                _skip(step, e, events)
        if cache[step]:
            return step
    return None


def load_checkpoint(directory: str | os.PathLike, step: int, *, rank: int, world_size: int, run_id: str,
                    key: bytes, into: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify the manifest's signature and the checksums BEFORE deserializing; raise CheckpointError
    (a ValueError subclass) naming the file on mismatch, wrong key, wrong run_id, wrong world size.

    Returns (tensors, info): info holds step, generation, world_size, rank, strategy, run_id and
    the caller's `meta`. With `into`, tensors are loaded in place into those (same names, shapes
    and dtypes as saved) and `into` is returned.
    """
    doc = read_manifest(directory, step, rank=rank, world_size=world_size, run_id=run_id, key=check_key(key))
    sdir = step_dir(directory, step)
    mpath = manifest_path(directory, step, rank)
    specs = {name: (parse_dtype(s["dtype"], mpath), torch.Size(s["shape"]))
             for name, s in doc["tensors"].items()}
    if into is None:
        state = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}
    else:
        got = {name: (t.dtype, t.shape) for name, t in into.items()}
        if got != specs:
            raise CheckpointError(
                f"checkpoint file {mpath} holds tensors {_describe(specs)} but `into` has "
                f"{_describe(got)}; load without `into`, or build `into` for the saved layout", mpath)
        state = into
    blobs = verify_files(sdir, doc, keep_bytes=True)
    dcp.load(state, storage_reader=VerifiedReader(sdir / doc["data_dir"], blobs), no_dist=True)
    info = {k: doc[k] for k in ("step", "generation", "world_size", "rank", "strategy", "run_id", "meta")}
    return state, info


def _describe(specs: dict[str, tuple[torch.dtype, torch.Size]]) -> str:
    return "{" + ", ".join(f"{n}: {str(d).removeprefix('torch.')}{list(s)}"
                           for n, (d, s) in sorted(specs.items())) + "}"
