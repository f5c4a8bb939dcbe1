"""The optimizer state a rank owns and the chunked, transactional update of it.

`zero1`: rank r owns shard r of the flat parameters and its optimizer state (the user's
optimizer's per-element tensors, e.g. Adam's exp_avg and exp_avg_sq), updates it
chunk by chunk, then all ranks all-gather the parameters. Every `protect_every`-th step
(a parity step) also sends each window's parity deltas to their holders (one all-to-all);
in between, the ring of averaged gradients and the step log let a lost shard be decoded
at the last parity point and replayed. `zero2`: as zero1, but the gradient is reduce-scattered,
so a rank holds only its own shard's averaged gradient; with no peer holding a lost shard's
gradients there is nothing to replay from, so parity is brought up to date on every step
(protect_every 1) and a step cut short in its update is redone on every rank, applying only
the chunks that do not have it yet (`update` skips them; parity is then rebuilt at commit).
`zero3`: zero2 with the parameters sharded too: the rank's parameter shard (`param_shard`) is a
tensor of its own, not a slice of a full parameter buffer, so there is no all-gather at commit
(parallel/units.py gathers each unit of the model just in time); shards, chunks and parity are
zero2's. `fsdp`: zero3 with FSDP2's shard layout (parallel/fsdp_layout.py: each parameter split on
dim 0, the rank's padded slots concatenated), so that `fully_shard` computes with exactly the bytes
this state owns (runtime/fsdp.py). `ddp`: every rank owns everything (replicated); no parity is
needed because any survivor is a copy.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch
import torch.nn as nn

from unbroken.comm.group import Comm
from unbroken.config import SHARDED
from unbroken.parallel.buffers import ModelBuffers
from unbroken.parallel.flat import FlatModel
from unbroken.parallel.fsdp_layout import FsdpLayout
from unbroken.parallel.optim import ChunkOptimizer
from unbroken.parallel.groups import ParityGroups
from unbroken.protect.chunks import ChunkedState
from unbroken.protect.tier1 import PIPELINE, ParityLayout, Tier1
from unbroken.protect.txn import StepScalars, TxnLog

Point = Callable[[str, int], None]  # fault-injection hook: point(phase, chunk)


Run = tuple[int, int, int]  # (start, end, param group) over a rank's shard


class OwnedState:
    def __init__(self, named: list[tuple[str, nn.Parameter]], group_of: list[int], optim: ChunkOptimizer,
                 buffers: ModelBuffers, *, strategy: str, rank: int, world: int, group_size: int,
                 chunk_elems: int, protect_every: int = 1, grad_slots: int | None = None, nnodes: int = 1) -> None:
        self.strategy, self.rank, self.world, self.optim, self.buffers = strategy, rank, world, optim, buffers
        sharded = strategy in SHARDED
        self.k = group_size if (sharded and group_size >= 2) else 1
        # parity every K steps; the gradient ring keeps the K averaged gradients a replay needs
        # (zero2 keeps none: parity every step)
        if self.sharded_grads:
            protect_every, grad_slots = 1, 1
        self.protect_every = protect_every if self.k >= 2 else 1
        # fsdp: FSDP2's slots in place of the flat order (None: the flat order's contiguous shards)
        self.fsdp = (FsdpLayout([p.shape for _, p in named], [name for name, _ in named], world)
                     if strategy == "fsdp" else None)
        self.flat = FlatModel(named, world=world if sharded else 1, chunk_elems=chunk_elems,
                              multiple=max(1, self.k - 1),
                              grad_slots=max(self.protect_every, grad_slots or 1) if self.k >= 2 else 1,
                              ranks=world, buffer_words=buffers.words, min_shard=self.fsdp.size if self.fsdp else 0)
        self.lo, self.hi = self.flat.shard_range(rank if sharded else 0)
        n = self.hi - self.lo
        # zero3, fsdp: the shard is the only copy of these parameters this rank keeps (flat.params,
        # the full buffer, lives only until the initial sync: drop_full)
        self.param_shard = (self.flat.params[self.lo:self.hi].clone() if self.sharded_params
                            else self.flat.params[self.lo:self.hi])
        dev = self.flat.device  # all of a rank's state lives where its model does
        self.opt_state = {name: torch.zeros(n, device=dev) for name in optim.state_names}
        if self.fsdp is not None:
            self.flat.pad_from = self.flat.n_pad  # its gradient slots are written whole (runtime/fsdp.py)
            self.fsdp.shard_from_full(self.flat.params, self.param_shard, rank)
            self._runs = self.fsdp.runs(rank, group_of)
        else:
            self._runs = _group_runs(self.flat.plist, group_of, self.lo, self.hi)
        self.reset_state()
        trailer = self.k if self.k >= 2 else 0
        self.state = ChunkedState([self.param_shard, *self.opt_state.values()],
                                  self.flat.chunk_elems, trailer_words=trailer)
        e = self.state.chunk_elems
        # each chunk in two halves: fault phase `midchunk` fires between them
        self._chunk_runs = [(_runs_in(self._runs, c * e, c * e + e // 2), _runs_in(self._runs, c * e + e // 2, c * e + e))
                            for c in range(self.state.n_chunks)]
        self.layout = ParityLayout(self.k, self.state.n_chunks) if self.k >= 2 else None
        self.groups = ParityGroups(world, self.k, nnodes)  # who protects whom (spread over nodes)
        self.member = self.groups.member_of(rank)
        self.txn = TxnLog(self.state.n_chunks, self.layout.n_windows if self.layout else 0)
        self.tier1, self.snap = None, None
        if self.layout:
            self.snap = ChunkedState([torch.zeros(n, device=dev) for _ in self.state.tensors], self.flat.chunk_elems,
                                     trailer_words=trailer)
            self.tier1 = Tier1(self.state, self.layout, self.member, self.txn, self.snap)
        self.next_parity = self.protect_every  # the next step whose update brings parity up to date
        self.rebuild_at: int | None = None  # zero2: a redone step after which parity is rebuilt in full
        self.log_from = 1  # the first step whose averaged gradient our ring is known to hold

    def reset_state(self) -> None:
        """The optimizer state of a fresh optimizer (zeros; Adagrad's initial accumulator)."""
        for name, t in self.opt_state.items():
            t.zero_()
            for a, b, g in self._runs:
                value = self.optim.initial_value(name, g)
                if value:
                    t[a:b].fill_(value)

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def sharded_grads(self) -> bool:
        """zero2, zero3, fsdp: each rank holds only its own shard of the averaged gradient."""
        return self.strategy in ("zero2", "zero3", "fsdp")

    @property
    def sharded_params(self) -> bool:
        """zero3, fsdp: each rank holds only its own shard of the parameters (outside forward/backward)."""
        return self.strategy in ("zero3", "fsdp")

    def drop_full(self) -> None:
        """zero3, after the initial sync (or at once, for a shadow): the shard from the full
        buffer, which is then freed."""
        if self.sharded_params and self.flat.params is not None:
            if self.fsdp is not None:
                self.fsdp.shard_from_full(self.flat.params, self.param_shard, self.rank)
            else:
                self.param_shard.copy_(self.flat.params[self.lo:self.hi])
            self.flat.params = None

    @property
    def snapshot_bytes(self) -> int:
        return 0 if self.snap is None else self.state.n_chunks * self.state.chunk_bytes

    def protection_bytes(self, *, checkpoint_writer: bool) -> dict[str, int]:
        """What protection holds on this rank beyond training itself, by part: tier-1 parity,
        its pipeline windows, the snapshot parity encodes, the gradient ring (all K slots) and,
        where this rank writes tier-2 checkpoints, their host staging copy of its tensors."""
        t1 = self.tier1
        staging = sum(t.numel() * t.element_size() for t in self.tensors().values()) if checkpoint_writer else 0
        return {"parity": 0 if t1 is None else t1.parity_bytes, "parity_pipeline": 0 if t1 is None else t1.pipeline_bytes,
                "snapshot": self.snapshot_bytes, "gradient_log": self.gradient_log_bytes, "checkpoint_staging": staging}

    @property
    def gradient_log_bytes(self) -> int:
        return 0 if self.tier1 is None else self.flat.grad_slots * self.flat.grads.numel() * 4

    def set_interval(self, k: int) -> None:
        """A new protect_every, from the current parity point on (the ring must hold K)."""
        assert 1 <= k <= self.flat.grad_slots, f"protect_every {k} exceeds the gradient ring ({self.flat.grad_slots})"
        self.protect_every = k
        self.next_parity = self.txn.snap_ver + k

    def parity_due(self, step: int) -> bool:
        return self.tier1 is not None and step >= self.next_parity and step != self.rebuild_at

    # --- one chunk ---------------------------------------------------------------------
    def apply_chunk(self, c: int, s: StepScalars, point: Point | None = None) -> None:
        """Apply step s to chunk c with step s's averaged gradient (from the ring)."""
        first, second = self._chunk_runs[c]
        self._apply_runs(first, s)
        if point is not None:
            point("midchunk", c)
        self._apply_runs(second, s)
        self.txn.commit_chunk(c, s.step)

    def _apply_runs(self, runs: list[Run], s: StepScalars) -> None:
        if s.skip:
            return
        grads, lo = self.flat.grads_of(s.step), self.lo
        for a, b, g in runs:
            grad = grads[lo + a:lo + b]
            if s.clip_coef != 1.0:
                grad = grad * s.clip_coef  # as clip_grad_norm_; the ring keeps the unclipped gradient
            self.optim.apply(self.param_shard[a:b], grad, {k: t[a:b] for k, t in self.opt_state.items()},
                             s.groups[g], s.step)

    # --- the step's update ---------------------------------------------------------------
    def update(self, s: StepScalars, group: Comm | None, point: Point, *, parity: bool) -> None:
        """Apply step s to every chunk; on a parity step also send each window's deltas
        (snapshot XOR new) to their holders."""
        self.txn.begin(s)
        if not parity:
            for c in range(self.state.n_chunks):
                point("optimizer", c)
                if self.txn.chunk_ver[c] < s.step:  # (a zero2 redo: chunks that have the step keep it)
                    self.apply_chunk(c, s, point)
            return
        lay, inflight = self.layout, []
        for w in range(lay.n_windows):
            if len(inflight) == PIPELINE:
                self.tier1.finish_window(group, *inflight.pop(0), s.step)
            for holder, c in zip(lay.holders(self.member), lay.window_chunks(self.member, w)):
                point("optimizer", c)
                self.apply_chunk(c, s, point)
                self.tier1.stage_delta(w, holder, c)
            point("parity", w)
            inflight.append((self.tier1.start_window(group, w), w))
        while inflight:
            self.tier1.finish_window(group, *inflight.pop(0), s.step)

    def commit(self, world: Comm, *, parity_step: int | None = None) -> None:
        """Make the step visible everywhere: all-gather the updated parameter shards. After a
        parity step, its completion proves every holder absorbed every window: the snapshot
        moves to this step."""
        if self.sharded and self.world > 1 and not self.sharded_params:
            # in place: each rank's shard is already in its slot of the flat buffer
            world.allgather_into(self.flat.params, self.flat.params[self.lo:self.hi], what="parameter all-gather")
        if parity_step is not None:
            self.take_snapshot(parity_step)

    def finish_redo(self, group: Comm, step: int) -> float | None:
        """After a zero2 step redone on top of kept chunks commits: parity in full at `step`
        (its update sent no deltas: a holder may already have absorbed some of them)."""
        if self.rebuild_at != step:
            return None
        self.rebuild_at = None
        return self.rebuild_parity(group, step)

    def roll_back_to_snapshot(self) -> None:
        """zero3, an update cut short before any parity window absorbed it: every chunk back to the
        snapshot (the state the parity still encodes), so the step can be redone from there."""
        self.state.copy_from(self.snap)
        self.txn.chunk_ver[:] = self.txn.snap_ver

    def take_snapshot(self, step: int) -> None:
        if self.snap is not None:
            self.snap.copy_from(self.state)
        self.txn.snapshot_taken(step)
        self.next_parity = step + self.protect_every

    def rebuild_parity(self, group: Comm, step: int) -> float:
        """Full parity build at `step` (every chunk there): snapshot, encode, new interval."""
        self.take_snapshot(step)
        return self.tier1.build(group, step)

    def replay_to(self, target: int) -> int:
        """Bring every chunk to `target` by re-applying the logged steps (their scalars and the
        ring's gradients); elementwise, so the bytes equal a failure-free run's. Returns the
        number of chunk updates applied."""
        n = 0
        for c in range(self.state.n_chunks):
            for step in range(int(self.txn.chunk_ver[c]) + 1, target + 1):
                self.apply_chunk(c, self.txn.scalars_for(step))
                n += 1
        return n

    # --- persistence -------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint (and a replica hand-off) holds: the parameter shard, its optimizer
        state and the committed model buffers."""
        return {"params": self.param_shard, **self.opt_state, "buffers": self.buffers.committed}

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        mine = self.tensors()
        if set(tensors) != set(mine):
            raise ValueError(f"checkpoint holds {sorted(tensors)}, this job needs {sorted(mine)}: "
                             "was it written with another optimizer or model?")
        for name, t in mine.items():
            src = tensors[name]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)} {src.dtype}, "
                                 f"this job needs {tuple(t.shape)} {t.dtype}: was it written by another config?")
            t.copy_(src)
        self.buffers.restore()
        self.txn.chunk_ver[:] = step
        self.txn.history.clear()
        self.log_from = step + 1


def _group_runs(plist: list[nn.Parameter], group_of: list[int], lo: int, hi: int) -> list[Run]:
    """Maximal runs of shard elements [lo, hi) whose parameters share a param group (shard-relative);
    the padding past the last parameter belongs to no run (it is never updated)."""
    runs: list[Run] = []
    off = 0
    for p, g in zip(plist, group_of):
        a, b = max(off, lo), min(off + p.numel(), hi)
        off += p.numel()
        if a >= b:
            continue
        if runs and runs[-1][1] == a - lo and runs[-1][2] == g:
            runs[-1] = (runs[-1][0], b - lo, g)
        else:
            runs.append((a - lo, b - lo, g))
    return runs


def _runs_in(runs: list[Run], a: int, b: int) -> list[Run]:
    """The parts of `runs` inside [a, b)."""
    out = []
    i = max(0, bisect.bisect_right([r[0] for r in runs], a) - 1)
    for start, end, g in runs[i:]:
        if start >= b:
            break
        x, y = max(start, a), min(end, b)
        if x < y:
            out.append((x, y, g))
    return out
