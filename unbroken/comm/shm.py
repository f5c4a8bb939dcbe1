"""The shared-memory all-reduce of ranks on one host (`--collectives shm`).

gloo moves a host's all-reduce through TCP loopback: a ring copies 1.5x the tensor into and out of
the kernel on every rank, on the same cores backward runs on. Ranks on one host can reduce through
one shared file instead:

    1. every rank copies its tensor into its row of the file;
    2. the ranks meet;
    3. each rank sums its 1/N of the elements over the rows in rank order (`reduce_rows`, the
       reduction every pattern of comm/patterns.py uses: the results are theirs, bit for bit) and
       writes the sum over row 0's elements (no other rank reads those);
    4. the ranks meet again, and each copies row 0 out.

Two regions alternate between collectives. A rank writes collective k+2's row into the region of
collective k only after it passed collective k+1's first meeting, which every rank reaches only
after it copied collective k's result out: no row is overwritten while a slower rank reads it.
A tensor larger than a row goes in row-sized pieces, one such collective each.

At a meeting each rank raises its flag in the file (an int64 in a cache line of its own) to the
meeting's number and polls the others' (`_meet`): every wait ends by the collective's deadline, a
dead peer (whose flag never rises) fails it there in every survivor, and a newer generation
interrupts it at once. Plain stores seen in program order make a raised flag vouch for the rows
written before it, so hosts without that order are refused (`usable_here`). Setup goes over the
job's gloo group, through a `Transport`: the file is made by rank 0 under /dev/shm with a random
name it sends to the others, its pages reserved up front and its rows made smaller when the free
space is short (a full /dev/shm is an error at setup, never a SIGBUS at a write); once every rank
has mapped it, rank 0 unlinks it, so nothing is left behind when the job ends or dies. A rank on
another host cannot map it: setup fails on every rank with a message naming the fix.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from unbroken.comm.group import CollectiveError, GenerationChanged
from unbroken.comm.patterns import pieces_of, reduce_rows, tag
from unbroken.comm.transport import Transport

ROW_BYTES = 16 << 20  # one rank's row: a larger tensor goes in pieces of this size
SHM_DIR = Path("/dev/shm")
NAME_BYTES = 128  # the file name rank 0 sends, padded
PHASE_SETUP, PHASE_WRITTEN, PHASE_REDUCED = 0, 1, 2
FLAG_STRIDE = 8  # int64s per rank's flag: one cache line each
FLAG_SPINS, FLAG_BACKOFF_S = 16, 0.0001  # polls that only yield the core, then this sleep between polls
MIN_ROW_BYTES = 64 << 10  # below this a collective would be mostly meetings: refuse instead
STORE_ORDERED = ("x86_64", "AMD64")  # hosts whose plain stores other cores see in program order


def usable_here() -> bool:
    """Whether this host's store order lets a flag seen set vouch for the rows written before it."""
    return platform.machine() in STORE_ORDERED


def fit_rows(row_bytes: int, world: int, free_bytes: int) -> int:
    """The row size to use: `row_bytes`, or less so that the file takes at most half of
    `free_bytes` (rows are pieces: a smaller row means more of them). OSError when even
    MIN_ROW_BYTES rows do not fit."""
    fits = (free_bytes // 2 - world * FLAG_STRIDE * 8) // (2 * world) // 64 * 64
    if fits < MIN_ROW_BYTES:
        raise OSError(f"{free_bytes >> 20} MB free, {(4 * world * MIN_ROW_BYTES) >> 20} MB needed")
    return min(row_bytes, fits)


def free_bytes(where: Path) -> int:
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize


class ShmAllreduce:
    """Sum-all-reduces of `rank` of `world` (all on this host) over gloo group `pg`; every wait ends
    by `timeout_s`. Set up at the first call (every rank makes the same calls in the same order)."""

    mode = "shm"

    def __init__(self, pg, *, rank: int, world: int, timeout_s: float, row_bytes: int = ROW_BYTES,
                 interrupted: Callable[[], bool] | None = None) -> None:
        if not usable_here():
            raise ValueError(f"--collectives shm relies on x86-64's store order (a flag seen set means the rows "
                             f"before it are written), and this host is {platform.machine()}; use --collectives gloo")
        if row_bytes < 64 or row_bytes % 64:
            raise ValueError(f"shm row_bytes must be a positive multiple of 64, got {row_bytes!r}; e.g. {ROW_BYTES}")
        self.rank, self.world, self.row_bytes = rank, world, row_bytes
        self.tp = Transport(pg, rank=rank, world=world, timeout_s=timeout_s, interrupted=interrupted)
        self._interrupted = interrupted
        self.seq = 0
        self._buf: torch.Tensor | None = None  # the mapped file as bytes: 2 regions x world rows
        self._map: mmap.mmap | None = None
        self._flags: np.ndarray | None = None  # after the rows: each rank's meeting number

    def __call__(self, t: torch.Tensor, what: str = "all-reduce") -> None:
        """Sum `t` (contiguous, on the CPU) over the ranks in place."""
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what}: the shared-memory all-reduce takes contiguous CPU tensors, got "
                             f"{t.device} with strides {t.stride()}")
        flat = t.view(-1)
        if self.world == 1 or flat.numel() == 0:
            return
        if self._buf is None:
            self._setup(what)
        per_row = self.row_bytes // flat.element_size()
        for a, z in ((a, min(a + per_row, flat.numel())) for a in range(0, flat.numel(), per_row)):
            self._piece(flat[a:z], what)

    def _row(self, region: int, r: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        start = (region * self.world + r) * self.row_bytes
        return self._buf[start:start + n * dtype.itemsize].view(dtype)

    def _piece(self, x: torch.Tensor, what: str) -> None:
        self.seq += 1
        self.tp.begin()
        region, n = self.seq % 2, x.numel()
        self._row(region, self.rank, x.dtype, n).copy_(x)
        self._meet(PHASE_WRITTEN, f"{what} (rows written)")
        mine = pieces_of(0, n, self.world)
        if self.rank < len(mine):  # fewer elements than ranks: the last ranks own none
            a, z = mine[self.rank]
            rows = [self._row(region, r, x.dtype, n)[a:z] for r in range(self.world)]
            # summed apart, then copied over row 0: summing into row 0 in place would start from
            # x_0 instead of 0 + x_0, which keeps a -0.0 the other patterns' sums turn into +0.0
            rows[0].copy_(reduce_rows(rows))
        self._meet(PHASE_REDUCED, f"{what} (sums written)")
        x.copy_(self._row(region, 0, x.dtype, n))

    def _meet(self, phase: int, what: str) -> None:
        """Every rank has reached this point: each raises its flag to this meeting's number and
        polls the others' (yielding its core, then backing off to FLAG_BACKOFF_S), until the
        collective's deadline or a newer generation."""
        target = 2 * self.seq + phase  # meetings only ever count up: an old flag never passes a new one
        self._flags[self.rank * FLAG_STRIDE] = target
        deadline, polls = time.monotonic() + self.tp.timeout_s, 0
        while self._flags[::FLAG_STRIDE].min() < target:
            polls += 1
            os.sched_yield() if polls < FLAG_SPINS else time.sleep(FLAG_BACKOFF_S)
            if polls % FLAG_SPINS == 0:
                if self._interrupted is not None and self._interrupted():
                    self.tp.broken = f"{what}: a newer generation was published while waiting"
                    raise GenerationChanged(f"rank {self.rank}/{self.world}: {self.tp.broken}")
                if time.monotonic() > deadline:
                    late = [r for r in range(self.world) if self._flags[r * FLAG_STRIDE] < target]
                    self.tp.broken = f"{what}: rank(s) {late} did not arrive within {self.tp.timeout_s:.1f}s"
                    raise CollectiveError(f"rank {self.rank}/{self.world}: {self.tp.broken}")

    # --- setup ---------------------------------------------------------------------------------
    def _rows_bytes(self) -> int:
        """The two regions of rows; the flags follow them."""
        return 2 * self.world * self.row_bytes

    def _size(self) -> int:
        return self._rows_bytes() + self.world * FLAG_STRIDE * 8

    def _setup(self, what: str) -> None:
        """Rank 0 makes the file (rows sized to the free space) and sends its name and row size;
        each rank maps it and says whether it could; rank 0 unlinks it and tells everyone whether
        all could (else every rank raises). An empty name: rank 0 could not make it."""
        self.tp.begin()
        failed = self._setup_rank0(what) if self.rank == 0 else self._setup_peer(what)
        if failed:
            self.close()
            raise CollectiveError(f"{what}: --collectives shm needs every rank on one host, but {failed} "
                                  f"rank(s) could not map rank 0's file under {SHM_DIR}; use --collectives gloo "
                                  "(or chain) on a job of several nodes")

    def _setup_rank0(self, what: str) -> int:
        tp, peers = self.tp, range(1, self.world)
        name, row = torch.zeros(NAME_BYTES, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        path, error = SHM_DIR / f"unbroken-allreduce-{uuid.uuid4().hex}", None
        try:
            self.row_bytes = fit_rows(self.row_bytes, self.world, free_bytes(SHM_DIR))
            self._map_file(path, self._size(), create=True)
            name[:len(str(path))] = torch.tensor(list(str(path).encode()), dtype=torch.uint8)
            row[0] = self.row_bytes
        except OSError as e:
            path.unlink(missing_ok=True)
            error = e
        tp.wait([tp.send(x, r, tag(0, PHASE_SETUP, 0, k)) for r in peers for k, x in enumerate((name, row))],
                f"{what} (setup)")
        if error is not None:
            self.close()
            raise CollectiveError(f"{what}: --collectives shm could not reserve its file under {SHM_DIR} ({error}); "
                                  "free space there (a container's --shm-size) or use --collectives gloo")
        oks = [torch.zeros(1, dtype=torch.uint8) for _ in range(self.world)]
        try:
            tp.wait([tp.recv(oks[r], r, tag(0, PHASE_SETUP, r, 0)) for r in peers], f"{what} (setup)")
        finally:
            path.unlink(missing_ok=True)  # every rank has it mapped (or failed): the name may go
        verdict = torch.tensor([sum(not int(oks[r]) for r in peers)], dtype=torch.uint8)
        tp.wait([tp.send(verdict, r, tag(0, PHASE_SETUP, 0, 2)) for r in peers], f"{what} (setup)")
        return int(verdict)

    def _setup_peer(self, what: str) -> int:
        tp, me = self.tp, self.rank
        name, row = torch.zeros(NAME_BYTES, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        tp.wait([tp.recv(x, 0, tag(0, PHASE_SETUP, 0, k)) for k, x in enumerate((name, row))], f"{what} (setup)")
        text = bytes(name.tolist()).rstrip(b"\0").decode()
        if not text:
            self.close()
            raise CollectiveError(f"{what}: rank 0 could not make the shared-memory file (its log says why); "
                                  "use --collectives gloo")
        self.row_bytes = int(row[0])
        try:
            self._map_file(Path(text), self._size(), create=False)
            ok = torch.ones(1, dtype=torch.uint8)
        except OSError:
            ok = torch.zeros(1, dtype=torch.uint8)
        tp.wait([tp.send(ok, 0, tag(0, PHASE_SETUP, me, 0))], f"{what} (setup)")
        verdict = torch.zeros(1, dtype=torch.uint8)
        tp.wait([tp.recv(verdict, 0, tag(0, PHASE_SETUP, 0, 2))], f"{what} (setup)")
        return int(verdict)

    def _map_file(self, path: Path, size: int, *, create: bool) -> None:
        """Map the file (rank 0: make it and reserve its pages first, so that a full /dev/shm is an
        error here and never a SIGBUS at the first write into a page the file does not have)."""
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=self.world * FLAG_STRIDE,
                                    offset=self._rows_bytes())

    def close(self) -> None:
        """The group is retired: the transport's threads may end; the mapping goes with its last view."""
        self.tp.close()
        self._buf = self._flags = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass
            self._map = None
