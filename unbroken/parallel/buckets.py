"""Gradient buckets: all-reduce slices of the flat gradient while backward still runs, as torch DDP does.

Parameters are grouped, in reverse registration order (roughly the order backward produces
their gradients), into buckets of about `bucket_elems` contiguous elements of the flat
gradient (the first one, whose gradients are ready first, of about `first_elems`: small, so
communication starts early in backward); the first bucket also covers the padding and the slots past the parameters. A
post-accumulate-grad hook copies each gradient into its slice (and into the kept local
copy) and drops the parameter's own `.grad` at once, so the step never holds two full
gradients besides the kept copy; once a bucket is complete *and every bucket before it has been issued*, its
all-reduce is issued. So every rank issues the same collectives in the same order, the
boundaries never change (the reduction is bitwise reproducible), and a redo that issues
the kept local gradient bucket by bucket (`issue_all`) gives the same bits. `timeline` holds
the last step's bucket times (issued, seen done) from the start of backward (or of `issue_all`).
"""
from __future__ import annotations

import time

import torch

from unbroken.comm.group import Comm, Pending
from unbroken.parallel.flat import FlatModel


class _Round:
    """One step's backward: where gradients go, what is still missing, what was issued."""

    def __init__(self, comm: Comm, grads: torch.Tensor, local: torch.Tensor, n_buckets: int,
                 missing: list[int], poison: bool, what: str) -> None:
        self.comm, self.grads, self.local, self.what = comm, grads, local, what
        self.missing = list(missing)
        self.next = 0  # the next bucket to issue
        self.pending: list[Pending] = []
        self.poison = poison  # fault injection: a NaN in element 0 before it is sent
        self.seen = [False] * sum(missing)
        self.t0 = time.perf_counter()
        self.spans: list[list[float | None]] = []  # per issued bucket: [issued, seen done] (s from t0)

    def stamp_done(self) -> None:
        now = time.perf_counter() - self.t0
        for p, span in zip(self.pending, self.spans):
            if span[1] is None and p.done.is_set():
                span[1] = now


class GradBuckets:
    def __init__(self, flat: FlatModel, bucket_elems: int, first_elems: int | None = None) -> None:
        if bucket_elems < 1 or (first_elems is not None and first_elems < 1):
            raise ValueError(f"bucket sizes must be >= 1 element, got {bucket_elems} and first {first_elems}")
        self.flat = flat
        offs, off = [], 0
        for p in flat.plist:
            offs.append((off, p.numel()))
            off += p.numel()
        self.offsets = offs
        self.ranges: list[tuple[int, int]] = []  # bucket b covers grads[lo:hi]
        self.bucket_of: list[int] = [0] * len(offs)
        members: list[int] = []
        hi = flat.grads.numel()  # + the spare slots and the loss
        for i in reversed(range(len(offs))):
            members.append(i)
            lo = offs[i][0]
            if hi - lo >= (bucket_elems if self.ranges or first_elems is None else first_elems) or i == 0:
                for j in members:
                    self.bucket_of[j] = len(self.ranges)
                self.ranges.append((lo, hi))
                members, hi = [], lo
        self.sizes = [0] * len(self.ranges)
        for b in self.bucket_of:
            self.sizes[b] += 1
        self._round: _Round | None = None
        self.timeline: dict | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))
                       for i, p in enumerate(flat.plist)]

    def close(self) -> None:
        """Remove the hooks (the Trainer rebuilds its state when a shadow takes a rank)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def n_buckets(self) -> int:
        return len(self.ranges)

    def begin(self, comm: Comm, grads: torch.Tensor, local: torch.Tensor, loss: float, *, poison: bool,
              what: str) -> None:
        """Arm the hooks for one backward: gradients land in `grads` (and `local`); the padding
        and the loss are set now, the spare slots must be already."""
        grads[self.flat.n:self.flat.n_pad].zero_()
        grads[self.flat.loss] = loss
        self._round = _Round(comm, grads, local, self.n_buckets, self.sizes, poison, what)

    def finish(self, on_landed=None) -> None:
        """After backward: zero what no gradient reached (unused parameters), issue the rest and
        wait for every bucket, in order, calling on_landed(b) as bucket b completes (the eager
        update, parallel/eager.py). Raises CollectiveError."""
        r, self._round = self._round, None
        assert r is not None, "GradBuckets.finish() without begin()"
        for i, done in enumerate(r.seen):
            if not done:
                lo, n = self.offsets[i]
                r.grads[lo:lo + n].zero_()
                r.seen[i] = True
                r.missing[self.bucket_of[i]] -= 1
        self._issue_ready(r)
        backward_s = time.perf_counter() - r.t0
        for b, p in enumerate(r.pending):
            r.comm.finish(p)
            r.stamp_done()
            if on_landed is not None:
                on_landed(b)
        self.timeline = {"backward_s": backward_s, "end_s": time.perf_counter() - r.t0, "buckets": r.spans}

    def issue_all(self, comm: Comm, grads: torch.Tensor, what: str) -> None:
        """All-reduce `grads` (already holding the local gradient) bucket by bucket, in the
        order backward issues them; wait for all. Raises CollectiveError."""
        t0 = time.perf_counter()
        pend = [comm.allreduce_start(grads[lo:hi], what=f"{what} bucket {b}") for b, (lo, hi) in enumerate(self.ranges)]
        spans = [[0.0, None] for _ in pend]
        for p, span in zip(pend, spans):
            comm.finish(p)
            span[1] = time.perf_counter() - t0
        self.timeline = {"backward_s": 0.0, "end_s": time.perf_counter() - t0, "buckets": spans}

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        r = self._round
        if r is None or r.seen[i]:
            return  # a backward unbroken did not start (or a second accumulation): leave it alone
        lo, n = self.offsets[i]
        r.grads[lo:lo + n].copy_(p.grad.reshape(-1))
        p.grad = None  # copied: the flat buffer is the gradient now (one copy per rank, not two)
        r.seen[i] = True
        r.missing[self.bucket_of[i]] -= 1
        r.stamp_done()
        self._issue_ready(r)

    def _issue_ready(self, r: _Round) -> None:
        while r.next < self.n_buckets and r.missing[r.next] == 0:
            lo, hi = self.ranges[r.next]
            if r.poison and lo == 0:
                r.grads[0] = float("nan")
            r.local[lo:hi].copy_(r.grads[lo:hi])  # kept for a redo: survivors skip recomputation
            r.pending.append(r.comm.allreduce_start(r.grads[lo:hi], what=f"{r.what} bucket {r.next}"))
            r.spans.append([time.perf_counter() - r.t0, None])
            r.next += 1
