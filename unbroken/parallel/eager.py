"""Eager update: each chunk's optimizer update applied as soon as the gradient buckets covering
it are all-reduced, while later buckets are still on the wire, instead of after the last one.

The update of a chunk reads the step's global scalars (StepScalars: the clip coefficient from
the global gradient norm, skip for a non-finite step), which exist only once every bucket has
landed. So the eager part runs on a guess: the scalars of a step that is neither clipped nor
skipped. `settle` compares the guess with the real scalars: equal, the eager chunks are the
bytes the normal update would write (the same elementwise op on the same bytes); different (a
clipped or non-finite step), or the step cut short (a collective error, a numerics redo),
every eager chunk goes back to its bytes before the step from the undo copy taken just before
it changed, its version back to t-1 and the guessed scalars out of the step log: the state is
exactly the one the normal path holds at that point. The guess is only made when the last
step was not clipped (or clipping is off), so a run that clips every step never pays for it.

Transactions (protect/txn.py): a chunk still moves t-1 -> t once per step, through
`TxnLog.commit_chunk`, and the step's scalars are in the log before the first chunk moves;
`OwnedState.update` then applies only the chunks not at t yet. Eager is never used on a
tier-1 parity step (its update sends each window's deltas: collectives of their own), nor by
zero2/zero3 (the gradient is reduce-scattered whole), nor on a step a redo left part-applied.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from unbroken.parallel.buckets import GradBuckets
from unbroken.protect.chunks import ChunkedState
from unbroken.protect.txn import StepScalars

if TYPE_CHECKING:
    from unbroken.parallel.strategy import OwnedState


class EagerUpdate:
    def __init__(self, owned: "OwnedState", buckets: GradBuckets, world: int) -> None:
        self.owned, self.world = owned, world
        e = owned.state.chunk_elems
        # the chunk is ready once the bucket holding its first element has landed: buckets are issued
        # from the top of the flat gradient down, so that one is the last of those covering it
        self._ready: dict[int, list[int]] = {}
        for c in range(owned.state.n_chunks):
            first = owned.lo + c * e
            b = next(i for i, (lo, hi) in enumerate(buckets.ranges) if lo <= first < hi)
            self._ready.setdefault(b, []).append(c)
        self._ranges, self._n_avg = buckets.ranges, owned.flat.n_avg
        self._undo: ChunkedState | None = None  # allocated on first use
        self._point = None  # fault-injection hook passed on to apply_chunk
        self._logged: StepScalars | None = None  # the step log's entry for the step before the guess
        self.guess: StepScalars | None = None
        self.applied: list[int] = []
        self.divided = False  # this step's buckets were averaged as they landed
        self.last_clean = True  # the last settled step was neither clipped nor skipped
        self.last_kept, self.steps_kept = 0, 0  # chunks kept at the last step; steps with any kept
        self.busy_s = 0.0  # this step's time spent in `landed` (averaging and updating eagerly)

    def arm(self, step: int, groups: tuple, *, enabled: bool, point=None) -> None:
        """Before step `step`'s buckets are waited for: guess its scalars (with `groups`, the param
        groups' hyperparameters) where eager can be used (see the module docstring)."""
        assert not self.applied, "EagerUpdate.arm() with chunks of an unsettled step applied"
        self.busy_s = 0.0
        guess = eager_guess(self.owned, step, groups, enabled=enabled, last_clean=self.last_clean)
        self.guess, self.divided, self._point = guess, guess is not None, point
        if guess is not None:
            if self._undo is None:
                st = self.owned.state
                self._undo = ChunkedState([torch.empty_like(t) for t in st.tensors], st.chunk_elems)
            self._logged = self.owned.txn.history.get(step)  # (a redo may have logged it already)
            self.owned.txn.record(guess)  # in the log before any chunk moves

    def average(self, grads: torch.Tensor) -> None:
        """Divide the summed gradient by the world size where `landed` has not already."""
        if not self.divided:
            grads[:self._n_avg].div_(self.world)

    def landed(self, b: int) -> None:
        """Bucket b's all-reduce is complete: average it, apply every chunk it makes ready."""
        if self.guess is None:
            return
        t0 = time.perf_counter()
        lo, hi = self._ranges[b]
        self.owned.flat.grads[lo:min(hi, self._n_avg)].div_(self.world)
        st, undo = self.owned.state, self._undo
        for c in self._ready.get(b, ()):
            sl = st._sl(c)
            for w, u in zip(st.words, undo.words):
                u[sl].copy_(w[sl])
            self.applied.append(c)  # before it changes: a fault inside it still undoes it
            self.owned.apply_chunk(c, self.guess, self._point)
        self.busy_s += time.perf_counter() - t0

    def settle(self, real: StepScalars | None) -> int:
        """The step's real scalars (None: the step did not complete). Keeps the eager chunks if they
        equal the guess, else undoes them. Returns how many chunks were kept."""
        guess, self.guess, self.divided, self.last_kept = self.guess, None, False, 0
        if real is not None:
            self.last_clean = real.clip_coef == 1.0 and not real.skip
        if guess is None:
            return 0
        if real is not None:
            if real == guess:
                self.last_kept, self.applied = len(self.applied), []
                self.steps_kept += self.last_kept > 0
                return self.last_kept
        st, undo, txn = self.owned.state, self._undo, self.owned.txn
        for c in self.applied:
            sl = st._sl(c)
            for w, u in zip(st.words, undo.words):
                w[sl].copy_(u[sl])
            txn.chunk_ver[c] = guess.step - 1
        self.applied = []
        if txn.history.get(guess.step) == guess:  # the log as it was before the guess
            if self._logged is None:
                del txn.history[guess.step]
            else:
                txn.history[guess.step] = self._logged
        return 0


def eager_guess(owned, step: int, groups: tuple, *, enabled: bool, last_clean: bool) -> StepScalars | None:
    """The scalars to apply eagerly with at `step`, or None where eager cannot be used (see the
    module docstring): a parity step, zero2/zero3, chunks not all at step-1, or the last step clipped."""
    if not enabled or not last_clean or owned.sharded_grads or owned.parity_due(step):
        return None
    if not (owned.txn.chunk_ver == step - 1).all():
        return None
    return StepScalars(step=step, clip_coef=1.0, skip=False, groups=groups)
