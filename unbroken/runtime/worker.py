"""`Trainer`: the training-loop side of unbroken, the API a user script calls.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)     # the user's optimizer (and scheduler)
    trainer = unbroken.Trainer(model, opt)      # a shadow blocks here until it gets a rank
    loader = trainer.loader(dataset, batch_size=32)
    for step in trainer.steps():                # step numbers continue across recoveries
        x, y = loader.batch(step)
        trainer.step(lambda: loss_fn(model(x), y))  # forward only: backward, all-reduce and the
    trainer.finish()                            # optimizer step are unbroken's, redone on failure

On a collective error the Trainer does not exit: it waits for the supervisor's next
generation, joins it, brings its state to the agreed version and continues.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Callable

import torch
import torch.nn as nn

from unbroken.comm import bucketed
from unbroken.comm.group import CollectiveError, Comm, GenerationChanged
from unbroken.fsutil import atomic_write_bytes, atomic_write_with
from unbroken.memory import live_tensor_bytes, peak_rss_bytes
from unbroken.parallel.buckets import GradBuckets
from unbroken.parallel.buffers import ModelBuffers
from unbroken.parallel.eager import EagerUpdate
from unbroken.parallel.optim import ChunkOptimizer
from unbroken.parallel.schedule import ScheduleClock
from unbroken.parallel.strategy import OwnedState
from unbroken.config import ConfigError
from unbroken.protect.txn import StepScalars
from unbroken.runtime.autok import IntervalTuner, gradient_ring_slots
from unbroken.runtime.overlap_tune import overlap_control
from unbroken.runtime import adopt, crash, devices, membership, zero3
from unbroken.runtime.determinism import FORWARD, InputFingerprints, seed_everything
from unbroken.runtime.loop import LoopAPI
from unbroken.runtime.numerics import NonFiniteGradient, NumericsChecks, NumericsFault  # noqa: F401 (re-exported)
from unbroken.runtime.persist import Persistence
from unbroken.runtime.context import ProcessContext
from unbroken.runtime.recovery import RolledBack, finish_deferred_decode, recover, reporter, resume_from_tier2
from unbroken.runtime.state import RecoveryInputs, TrainState
from unbroken.runtime.faults import FaultInjector


class LayoutMismatch(ValueError):
    """Ranks disagree on model size, chunking, world size or strategy."""


def _update_is_unbrokens(*args, **kwargs) -> None:
    """What optimizer.step() does once the optimizer is a Trainer's: nothing (trainer.step updated)."""
    return None


class Trainer(LoopAPI, Persistence, NumericsChecks):
    """Train `model` with the user's `optimizer` (and `scheduler`), in place of DDP + optimizer.step().

    grad_clip: clip the global gradient norm to this (as clip_grad_norm_), None = no clipping.
    accumulation_steps: micro-batches per step; the closure is then called as closure(i),
    i = 0..n-1, and what it returns is backpropagated as it is (divide by n yourself, as in a
    plain accumulation loop); the step's loss is the sum of what it returned.
    scheduler_step: the scheduler is stepped after every step ("step"), every epoch of
    trainer.loader(...) ("epoch"), or every N steps.
    From here on the optimizer's step() and the scheduler's step() are no-ops (the update and
    the schedule are unbroken's), so a loop that still calls them means the same thing.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None, *,
                 grad_clip: float | None = None, accumulation_steps: int = 1,
                 scheduler_step: str | int = "step") -> None:
        self.ctx = ctx = ProcessContext.from_env()
        self.st = TrainState()  # where training is: the record recovery reads and moves
        # an uncaught exception is recorded for the leader, with the step it happened in
        crash.register(ctx, lambda: self.st.step_count + 1)
        cfg = self.cfg = ctx.config
        torch.set_num_threads(cfg.threads)  # same threads everywhere: bitwise-reproducible kernels
        self.model = model
        self.world_size = cfg.world_size
        self._adopt(model, optimizer, scheduler, grad_clip, accumulation_steps, scheduler_step)
        self.overlap = overlap_control(self)  # --overlap: bucket size, when buckets go, the core split
        self.fingerprints = InputFingerprints(keep=max(1024, cfg.checkpoint_every * (cfg.checkpoint_keep + 1)))
        self._planned: int | None = None
        self._finished = False
        self._attempts = 0  # trainer.step() calls (a loader iteration checks that the loop trains)
        self.local_grads: torch.Tensor | None = None  # allocated with the state (_build_state)
        self.comm: Comm | None = None
        self.group: Comm | None = None
        self.ours: bucketed.BucketedAllreduce | None = None  # --collectives static|adaptive|chain
        self.gen: membership.Generation | None = None
        self._pg_stores: list = []  # one store connection per generation's groups, kept alive
        self._nan_pending = False
        self._nonfinite_tries: dict[int, int] = {}  # step -> redos so far for a non-finite gradient
        self._slow_s = 0.0  # injected straggling (fault kind `slow`): extra seconds per step
        self._waited = 0.0
        self._norms: list[float] = []  # recent gradient norms (spike detection)
        self._t_step = time.perf_counter()
        self._phase_s: dict[str, float] = {}
        self._parity_step = False  # did the last step bring tier-1 parity up to date
        ctx.start_heartbeat()
        self.watch = membership.GenerationWatch(
            lambda: membership.connect_store(ctx.host, ctx.port, timeout_s=self.cfg.collective_timeout_s))
        if ctx.role == "shadow":
            self._serve_as_shadow()
        else:
            self._start_as_worker(ctx.rank)
        self.clock.move_to(self.st.step_count + 1)  # a process that joins later: the schedule where it is
        self.clock.started_at(self.st.step_count, lambda: self.st.step_count, self._refuse)
        self.rank_known()
        crash.at_clean_exit(self._finish_at_exit)
        crash.at_crash_exit(self._land_checkpoint)

    def _adopt(self, model, optimizer, scheduler, grad_clip, accumulation_steps, scheduler_step) -> None:
        """Take the user's objects, or stop the job with a one-line error naming the argument (exit 2)."""
        try:
            adopt.check_options(grad_clip, accumulation_steps)
            if not (scheduler_step in ("step", "epoch") or (isinstance(scheduler_step, int)
                                                             and not isinstance(scheduler_step, bool)
                                                             and scheduler_step >= 1)):
                raise adopt.AdoptionError(f"scheduler_step must be 'step', 'epoch' or an integer >= 1 (steps per "
                                          f"scheduler step), got {scheduler_step!r}")
            self.named, self.group_of = adopt.trained_parameters(model, optimizer)
            adopt.check_device(self.named, devices.bind_rank_device(self.cfg.backend, self.cfg.device))
            self.optim = ChunkOptimizer(optimizer)
            if self.optim.has_state():
                raise adopt.AdoptionError(
                    "the optimizer already holds state (was optimizer.load_state_dict called?): unbroken restores "
                    "optimizer state from its own checkpoints; pass a freshly built optimizer")
            self.clock = ScheduleClock(self.optim, scheduler,
                                       every=scheduler_step if isinstance(scheduler_step, int) else 1)
        except ValueError as e:
            self._refuse(str(e))
        self.grad_clip, self.accumulation_steps, self.scheduler_step = grad_clip, accumulation_steps, scheduler_step
        self.model_buffers = ModelBuffers(model)
        optimizer.step = _update_is_unbrokens  # the script's optimizer.step(): the update already happened

    def rank_known(self) -> None:
        """torchrun's variables for the script (a shadow learns its rank only now; its LOCAL_RANK
        stays the device slot it was started on: runtime/standby.py)."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))

    def _finish_at_exit(self) -> None:
        """The script returned without trainer.finish(): finish for it (final weights, done)."""
        if not self._finished and self.st.has_state:
            self.finish()

    def _refuse(self, msg: str) -> None:
        """A user mistake no retry can fix: the supervisor stops the job with `msg` (exit 2)."""
        self.ctx.store.set("abort", msg)
        raise crash.Refused(msg)

    # --- start-up ----------------------------------------------------------------------
    def _build_state(self, rank: int) -> None:
        self.rank = rank
        if getattr(self, "buckets", None) is not None:
            self.buckets.close()
        if getattr(self, "units", None) is not None:
            self.units.close()  # zero3: the parameters are plain tensors again before a new state reads them
        cfg = self.cfg
        try:
            slots = gradient_ring_slots(cfg, sum(p.numel() for _, p in self.named))
        except ConfigError as e:
            self._refuse(str(e))  # not recoverable: the supervisor stops the job (exit 2)
        self.tuner = IntervalTuner(mtbf_s=cfg.expected_mtbf_s, max_k=slots)
        n_tensors = 1 + len(self.optim.state_names)  # the parameter shard and its optimizer state
        self.owned = OwnedState(self.named, self.group_of, self.optim, self.model_buffers, strategy=cfg.strategy,
                                rank=rank, world=self.world_size,
                                group_size=cfg.effective_parity_group if cfg.tier1 else 1,
                                chunk_elems=max(16, cfg.chunk_kb * 1024 // (4 * n_tensors)),
                                protect_every=self.tuner.initial_k if cfg.protect_every == "auto"
                                else int(cfg.protect_every), grad_slots=slots, nnodes=self.ctx.nnodes)
        self.units = zero3.build_units(self.model, self.owned, lambda: self.comm)  # zero3: gathered per unit
        if self.st.has_state is not True:
            self.owned.drop_full()  # a shadow: its shard comes from recovery, never from the initial sync
        self.overlap.adopt_agreed(self.ctx.store)  # a member joining later: the plan its peers tuned
        self.buckets = GradBuckets(self.owned.flat, *self.overlap.plan.bucket_sizes)
        self.eager = EagerUpdate(self.owned, self.buckets, self.world_size)
        self.local_grads = zero3.kept_buffer(self.owned)
        self._shard_grad = zero3.shard_grad_buffer(self.owned)
        if self.ctx.role == "worker" or self.st.has_state is not None:
            self.ctx.phase["rank"] = rank
            self.ctx.events.rank = rank
        self.ckpt = self._make_checkpoint_writer()

    def _start_as_worker(self, rank: int) -> None:
        self.st.has_state = True
        self._build_state(rank)
        self.ctx.set_phase("build", 0)
        try:
            # a member lost while generation 0 connects supersedes it: recover like any other loss
            self._join(membership.read_generation(self.ctx.store, 0, self.cfg.collective_timeout_s))
            try:
                self._check_layout()
            except LayoutMismatch as e:
                self.ctx.store.set("abort", str(e))  # not recoverable: the supervisor stops the job
                raise
            if self.rank == 0:
                self._check_fault_chunks()
            self.comm.broadcast(self.owned.flat.params, src=0, what="initial parameter sync")
            self.owned.drop_full()  # zero3: keep only this rank's shard of them
            if self.model_buffers.words:  # as DDP at construction: rank 0's buffers everywhere
                self.comm.broadcast(self.model_buffers.committed, src=0, what="initial buffer sync")
                self.model_buffers.restore()
            self._point("build")
            if self.owned.tier1 is not None:
                secs = self.owned.rebuild_parity(self.group, 0)
                self.ctx.events.emit("parity_built", bytes=self.owned.tier1.parity_bytes, seconds=round(secs, 4),
                                     protect_every=self.owned.protect_every, xor=self.group.bitwise_path(
                                         self.owned.tier1.parity),
                                     snapshot_bytes=self.owned.snapshot_bytes,
                                     gradient_log_bytes=self.owned.gradient_log_bytes,
                                     protected_bytes=self.owned.state.n_chunks * self.owned.state.chunk_bytes)
            if self.ctx.resume:
                resume_from_tier2(self._recovery_inputs())
        except CollectiveError as e:
            self.ctx.events.emit("collective_error", step=0, phase="build", error=str(e)[:300])
            self.owned.drop_full()
            recover(self._recovery_inputs(), new_member=False)
        if not self.ctx.resume:
            self._maybe_checkpoint(0)
        if self.rank == 0:
            self._write_layout()

    def _check_layout(self) -> None:
        """Every rank must shard and chunk the same way; say which rank differs and how."""
        flat = self.owned.flat
        mine = {"params": flat.n, "dtype": "float32", "chunk_elems": flat.chunk_elems,
                "chunks": self.owned.state.n_chunks, "world": self.world_size, "strategy": self.cfg.strategy,
                "optimizer": self.optim.name, "state": list(self.optim.state_names), "groups": self.optim.n_groups,
                "buffer_bytes": self.model_buffers.nbytes, "accumulation_steps": self.accumulation_steps}
        everyone = self.comm.allgather_json(mine, what="layout check")
        for r, other in enumerate(everyone):
            if other != mine:
                diff = {k: (mine[k], other[k]) for k in mine if mine[k] != other.get(k)}
                raise LayoutMismatch(f"rank {r} has a different state layout from rank {self.rank}: {diff} "
                                     "(mine, theirs); every rank must run the same model and config")

    def _check_fault_chunks(self) -> None:
        """A --inject spec whose chunk index is past this layout's last chunk could never fire."""
        from unbroken.runtime.faults import unreachable_chunks

        owned = self.owned
        bad = unreachable_chunks(self.ctx.faults.specs, n_chunks=owned.state.n_chunks,
                                 n_windows=owned.layout.n_windows if owned.layout else 0)
        if bad:
            self._refuse(bad[0])

    def _serve_as_shadow(self) -> None:
        from unbroken.runtime.shadow import wait_for_assignment

        # Touch the flat buffers now so that taking over costs only the state transfer.
        self.st.has_state = None  # not yet a member: build buffers without claiming a rank
        self._build_state(0)
        self.st.has_state = False
        rank, gen = wait_for_assignment(self.ctx)
        self._build_state(rank)
        self.gen = None
        self.ctx.set_phase("shadow", 0)
        self._point("shadow")
        # Join the newest generation, not necessarily the one that assigned us: a second
        # failure may already have superseded it.
        recover(self._recovery_inputs(), new_member=True)

    @property
    def step_count(self) -> int:
        """The last committed step (steps continue across recoveries)."""
        return self.st.step_count

    def _recovery_inputs(self) -> RecoveryInputs:
        """What recovery needs, explicitly: it never sees the Trainer itself."""
        return RecoveryInputs(ctx=self.ctx, cfg=self.cfg, st=self.st, owned=self.owned, tuner=self.tuner, ckpt=self.ckpt, watch=self.watch, rank=self.rank,
                              world_size=self.world_size, join=self._join,
                              groups=lambda: (self.comm, self.group, self.gen), point=self._point,
                              report=self._report_collective_error)

    def _join(self, gen: membership.Generation) -> None:
        """Build this generation's groups over PrefixStore(f"gen{g}/...")."""
        cfg = self.cfg
        if self.comm is not None:
            self.comm.retire()
        if self.ours is not None:
            self.ours.close()
        if self.group is not None and self.group is not self.comm:
            self.group.retire()
        self.gen = gen
        self.ctx.phase["gen"] = gen.gen
        self.ctx.events.gen = gen.gen
        stale = lambda: self.watch.newer_than(gen.gen)  # noqa: E731
        # The group's rendezvous gets its own store connection: a TCPStore client serves one
        # request at a time, and nothing else (heartbeats, fault reports) may queue behind it.
        pg_store = membership.connect_store(self.ctx.host, self.ctx.port, timeout_s=cfg.collective_timeout_s)
        self._pg_stores.append(pg_store)
        kinds = dict(backend=devices.group_backend(cfg.backend), bitwise_reduce=cfg.bitwise_reduce)
        self.comm = Comm(membership.group_store(pg_store, gen.gen), rank=self.rank, world=self.world_size,
                         gen=gen.gen, timeout_s=cfg.collective_timeout_s, interrupted=stale, **kinds)
        try:
            self.ours = bucketed.for_comm(self.comm, self.overlap.collectives(), emit=self.ctx.events.emit, interrupted=stale)
        except ValueError as e:
            self._refuse(str(e))
        k = self.owned.k
        if k < 2 or k == self.world_size:
            self.group = self.comm
        else:
            groups = self.owned.groups
            self.group = Comm(membership.group_store(pg_store, gen.gen, f"parity{groups.group_of(self.rank)}"),
                              rank=groups.member_of(self.rank), world=k, gen=gen.gen,
                              timeout_s=cfg.collective_timeout_s, interrupted=stale, **kinds)

    # --- the loop ------------------------------------------------------------------------
    def step(self, closure: Callable[..., torch.Tensor]) -> float | None:
        """Run step `step_count + 1`: closure() (closure(i) for micro-batch i with accumulation_steps
        > 1) returns the loss; returns the loss averaged over ranks (and micro-batches).

        Returns NaN if a recovery rolled the job back further (the loop's next step number
        tells where it resumes).
        """
        t = self.st.step_count + 1
        self._attempts += 1
        while True:
            try:
                self._attempt(t, closure)
                return self.st.last_loss
            except NumericsFault as e:
                self.st.local_step = None  # the bad gradient is recomputed, never reused
                self.ctx.events.emit("numerics", step=t, what=str(e), action="redo step from protected state")
            except CollectiveError as e:
                self._report_collective_error(t, e)
                recover(self._recovery_inputs(), new_member=False)
                if self.st.step_count >= t:
                    return self.st.last_loss
                if self.st.step_count < t - 1:
                    return math.nan
            except RolledBack:
                if self.st.step_count < t - 1:
                    return math.nan

    def _report_collective_error(self, step: int, e: Exception) -> None:
        """Record it; tell the leader unless the generation already moved on (a peer died)."""
        self.ctx.events.emit("collective_error", step=step, phase=self.ctx.phase["phase"], error=str(e)[:300])
        if not isinstance(e, GenerationChanged) and self.gen is not None:
            try:
                membership.report_fault(self.ctx.store, {
                    "proc": self.ctx.proc, "fault": "collective_error", "gen": self.gen.gen, "rank": self.rank,
                    "time": time.time(), "error": str(e)[:300]})
            except Exception:  # noqa: BLE001 - the store is the supervisor's: if it is gone, so is the job
                pass

    def _attempt(self, t: int, closure: Callable[[], torch.Tensor]) -> None:
        try:
            self._attempt_step(t, closure)
        except BaseException:
            self.eager.settle(None)  # a step cut short: its eager chunks back to their bytes before it
            raise

    def _attempt_step(self, t: int, closure: Callable[[], torch.Tensor]) -> None:
        ctx, flat = self.ctx, self.owned.flat
        t0 = time.perf_counter()
        self.overlap.before_step(self, t, closure)
        grads = flat.use_grads_of(t)
        overlapped = False
        if self.st.local_step == t:
            # Our gradient of step t survived the failed all-reduce (parameters are unchanged
            # since: the step was never applied), so only the replacement computes its share.
            grads.copy_(self.local_grads)
            grads[flat.vote] = self._nonfinite_vote(t)
        else:
            # a pending decode votes on the world group first: then no bucket may be issued before it;
            # zero2 reduce-scatters the whole gradient at once (below)
            overlapped = (self.overlap.plan.during_backward and self.st.deferred is None
                          and not self.owned.sharded_grads)
            self._compute_local_gradient(t, closure, overlap=overlapped)
        if self.st.deferred is not None:
            finish_deferred_decode(self._recovery_inputs())
        ctx.set_phase("allreduce")
        self._point("allreduce", t)
        t1 = time.perf_counter()
        self.st.grads_step = None
        norm = self._reduce_gradient(t, grads, overlapped)
        self._point("reduced", t)
        loss = float(flat.grads[flat.loss])
        self._check_inputs(t)
        self._check_numerics(t, loss, norm)
        self._maybe_choose_interval(t)
        self.st.scalars = self._scalars(t, norm, loss)
        self.st.grads_step = t  # with its scalars: a recovery hands both to a new member
        ctx.set_phase("optimizer")
        t2 = time.perf_counter()
        parity = self.owned.parity_due(t)
        self.eager.settle(None if parity else self.st.scalars)  # kept if the guess was right, else undone
        self.owned.update(self.st.scalars, self.group, lambda phase, c: self._point(phase, t, c), parity=parity)
        ctx.set_phase("allgather")
        self._point("allgather", t)
        t3 = time.perf_counter()
        self.st.gathering_step = t  # from here other ranks' regions of the parameters may change
        self.owned.commit(self.comm, parity_step=t if parity else None)
        rebuilt = self.owned.finish_redo(self.group, t) is not None  # a zero2 redo: parity in full
        self.model_buffers.commit(flat.grads[flat.buffers])  # rank 0's, as DDP's broadcast gives them
        t4 = time.perf_counter()
        # where the step's time went: compute, gradient all-reduce, update (+parity), all-gather
        self._phase_s = {"compute": t1 - t0, "allreduce": t2 - t1, "update": t3 - t2, "allgather": t4 - t3,
                         "eager": self.eager.busy_s}  # the part of `allreduce` spent updating eagerly
        self._parity_step = parity or rebuilt
        self._finish_step(t, float(flat.grads[flat.loss]))

    def _reduce_gradient(self, t: int, grads: torch.Tensor, overlapped: bool) -> float:
        """Step t's gradient summed over the ranks (zero2/zero3: only this rank's shard); its norm."""
        flat = self.owned.flat
        if self.owned.sharded_grads:
            return zero3.reduce_scatter_gradient(self.comm, self.owned, grads, self._shard_grad, t)
        if overlapped:  # eager: each bucket's chunks updated as it lands (parallel/eager.py)
            self.eager.arm(t, tuple(self.clock.hyper_for(t)), enabled=self.overlap.plan.eager_update,
                           point=lambda phase, c: self._point(phase, t, c))
            self.buckets.finish(self.eager.landed)
        else:  # after backward, the same buckets in the same order as the overlapped path issues them:
            # a survivor redoing a step (its gradient kept) and a new member computing it overlapped
            # must issue the same collectives, whichever path each one takes
            self.buckets.issue_all(self.ours or self.comm, grads, what=f"gradient all-reduce step {t}")
        self.eager.average(flat.grads)  # what the eager update did not average as it landed
        return float(torch.linalg.vector_norm(flat.grads[:flat.n_pad]))

    def _compute_local_gradient(self, t: int, closure: Callable[..., torch.Tensor], *, overlap: bool) -> None:
        """Forward and backward of step t into flat.grads, and a copy kept for a redo. With
        `overlap`, the gradient buckets' all-reduces are issued while the last backward runs."""
        ctx, flat = self.ctx, self.owned.flat
        ctx.set_phase("forward", t)
        self._point("forward", t)
        if self._slow_s:
            time.sleep(self._slow_s)
        flat.zero_grad()
        if self.units is not None:
            self.units.begin_step()
        self.model_buffers.restore()  # a redone forward starts from the committed buffers
        n = self.accumulation_steps
        values = []
        for i in range(n):
            seed_everything(self.cfg.seed, t, self.rank, FORWARD + i)  # dropout masks replay
            loss = self._call(closure, i)
            values.append(float(loss.detach()))
            if i < n - 1:
                loss.backward()
        ctx.set_phase("backward")
        self._point("backward", t)
        value = math.fsum(values) if n > 1 else values[0]
        last = loss
        self.tuner.fill(flat.grads[flat.aux])
        flat.grads[flat.vote] = self._nonfinite_vote(t)
        self._fill_tail(flat.grads, value)
        if overlap:
            self.buckets.begin(self.ours or self.comm, flat.grads, self.local_grads, value, poison=self._nan_pending,
                               what=f"gradient all-reduce step {t}")
            last.backward()
        else:
            if self.units is not None:
                self.units.capture(flat.grads)  # zero3: each gradient lands as its unit's backward ends
            last.backward()
            flat.collect_grads(value, self.units.end_step() if self.units is not None else None)
            if self._nan_pending:
                flat.grads[0] = float("nan")
            kept = zero3.keep_local(self.owned, flat.grads, self.local_grads, t)
        self._nan_pending = False
        self.st.local_step = t if overlap else kept

    def _call(self, closure, i: int) -> torch.Tensor:
        loss = closure() if self.accumulation_steps == 1 else closure(i)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            self._refuse(f"trainer.step(closure): the closure must return the loss as a scalar tensor that "
                         f"requires grad (got {type(loss).__name__}"
                         f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}); "
                         "return the loss before calling .item() or .backward()")
        return loss

    def _fill_tail(self, grads: torch.Tensor, value: float) -> None:
        """The summed part of the all-reduce: this rank's loss in its slot, rank 0's buffers."""
        flat = self.owned.flat
        grads[flat.rank_loss] = 0.0
        grads[flat.rank_loss.start + self.rank] = value
        grads[flat.norm_sq] = 0.0
        if self.rank == 0:
            self.model_buffers.encode(grads[flat.buffers])
        else:
            grads[flat.buffers] = 0.0

    def _check_inputs(self, t: int) -> None:
        """A step computed again must have had the same inputs on every rank (determinism.py)."""
        flat = self.owned.flat
        changed = self.fingerprints.observe(t, flat.grads[flat.rank_loss])
        if changed:
            before = self.fingerprints.value(t)
            self.ctx.events.emit("nondeterministic_input", step=t, ranks=changed,
                                 first=[float(before[r]) for r in changed],
                                 again=[float(flat.grads[flat.rank_loss.start + r]) for r in changed],
                                 message=f"step {t} was computed again with different inputs on rank(s) {changed}: "
                                         "the script reads data unbroken cannot replay (a stateful iterator?); "
                                         "draw batches with trainer.loader or from the step number")

    def _scalars(self, t: int, norm: float, loss: float) -> StepScalars:
        """Step t's global scalars: the clip coefficient from the averaged gradient's norm and every
        group's hyperparameters; skip=True when a non-finite step is to be skipped."""
        groups = tuple(self.clock.hyper_for(t))
        if not (math.isfinite(norm) and math.isfinite(loss)):
            return StepScalars(step=t, clip_coef=0.0, skip=True, groups=groups)
        return StepScalars(step=t, clip_coef=adopt.clip_coefficient(self.grad_clip, norm), groups=groups)

    def _finish_step(self, t: int, loss: float) -> None:
        self.st.step_count, self.st.last_loss = t, loss
        now = time.perf_counter()
        step_s, self._t_step = now - self._t_step, now
        tokens = self.world_size * self.cfg.batch_size * self.cfg.model.seq_len
        waited = self.comm.waited_s + (self.group.waited_s if self.group is not self.comm else 0.0)
        wait_s, self._waited = max(0.0, waited - self._waited), waited
        # Heartbeats pair `step` (being executed) with the times of step-1: update them together.
        self.ctx.phase.update({"step": t + 1, "step_s": step_s, "wait_s": wait_s})
        parts = {f"{k}_s": round(v, 4) for k, v in self._phase_s.items()}
        self.tuner.observe(t, step_s, self._phase_s.get("update", 0.0), self._parity_step)
        self._phase_s = {}
        self.ctx.events.emit("step", step=t, loss=round(loss, 6), step_s=round(step_s, 4),
                             wait_s=round(wait_s, 4), tokens=tokens, parity=self._parity_step, **parts)
        if self.st.redo_since is not None:
            if reporter(self._recovery_inputs()):
                self.ctx.events.emit("recovery_phase", phase="redo", start=self.st.redo_since, end=time.time(), step=t)
            self.st.redo_since = None
        self.clock.move_to(t + 1)  # as scheduler.step() after optimizer.step(): the groups show step t+1's values
        if self.rank == 0:
            membership.put(self.ctx.store, "progress", {"step": t, "gen": self.gen.gen, "loss": loss, "step_s": step_s,
                                                        "tokens_per_s": tokens / max(step_s, 1e-9)})
        self._maybe_checkpoint(t)

    def _maybe_choose_interval(self, t: int) -> None:
        """protect_every "auto": on the step after the first parity point, every rank takes K from
        the averaged measurements the all-reduce just delivered (runtime/autok.py)."""
        owned = self.owned
        if (self.cfg.protect_every != "auto" or self.tuner.done or owned.tier1 is None
                or owned.txn.snap_ver == 0 or t != owned.txn.snap_ver + 1):
            return
        chosen = self.tuner.choose(owned.flat.grads[owned.flat.aux])
        if chosen is not None:
            owned.set_interval(chosen["protect_every"])
            if self.rank == 0:
                self.ctx.events.emit("protect_every_chosen", step=t, **chosen)

    # --- faults and checkpoints ------------------------------------------------------------
    def _point(self, phase: str, step: int | None = None, chunk: int = 0) -> None:
        spec = self.ctx.faults.due(phase, rank=self.rank, step=self.st.step_count + 1 if step is None else step,
                                   chunk=chunk)
        if spec is None:
            return
        self.ctx.events.emit("fault_injected", fault=spec.kind, phase=phase, step=spec.step, chunk=chunk)
        if spec.kind == "nan":
            self._nan_pending = True
        elif spec.kind == "slow":
            self._slow_s = spec.ms / 1000.0
        elif spec.kind == "linkdrop":
            self.comm.drop_links()  # every connection of this rank breaks; the process lives on
            if self.group is not self.comm:
                self.group.drop_links()
        elif spec.kind == "collerr":  # as if our wait had failed: peers completed, we did not
            raise CollectiveError(f"injected: rank {self.rank}'s collective failed after its peers completed it")
        elif spec.kind == "bitflip":
            if self.owned.tier1 is not None:
                self.owned.tier1.parity[chunk % self.owned.layout.n_windows][0] ^= 1
        else:
            FaultInjector.fire(spec)

    # --- the end ---------------------------------------------------------------------------
    def weights_sha256(self) -> str:
        """sha256 of the trained parameters in flat order (zero3: collective, shard by shard)."""
        flat = self.owned.flat
        if self.owned.sharded_params:
            return zero3.sharded_sha256(self.comm, self.owned)
        return hashlib.sha256(flat.params[:flat.n].cpu().numpy()).hexdigest()  # on the CPU: hashed in place

    def finish(self) -> str:
        """Write the final weights (rank 0, atomically, with checksum); returns their sha256."""
        self._finished = True
        self.ctx.set_phase("done", self.st.step_count)
        self._point("done", self.st.step_count)
        if self.ckpt is not None:
            self.ckpt.close(timeout=self.cfg.collective_timeout_s)
        # what training held (the final hash and write below are not training memory: a native
        # peer logs it here too; zero3 gathers every unit for the weights file)
        held, peak = live_tensor_bytes([p.grad for _, p in self.named if p.grad is not None]), peak_rss_bytes()
        digest = self.weights_sha256()
        self.ctx.events.emit("worker_done", steps=self.st.step_count, weights_sha256=digest,
                             device=str(self.owned.flat.device), peak_rss_bytes=peak, tensor_bytes=held,
                             protection_bytes=self.owned.protection_bytes(checkpoint_writer=self.ckpt is not None))
        full = self.units.gather_all() if self.units is not None else None  # fsdp: the state dict in full
        if self.rank == 0:
            # streamed into the temp file: no clone, no in-memory copy of the serialized weights
            # (the trained parameters are views of one flat buffer, saved once)
            state = full if full is not None else self.model.state_dict()
            atomic_write_with(self.ctx.run_dir / "weights.pt", lambda f: torch.save(state, f))
            atomic_write_bytes(self.ctx.run_dir / "weights.sha256", f"{digest}  parameters\n".encode())
        if self.units is not None:
            self.units.end_step()
        membership.put(self.ctx.store, f"done/{self.rank}", {"sha256": digest, "steps": self.st.step_count})
        return digest
