"""`OverlapControl`: a rank's overlap plan for the job (unbroken/parallel/overlap.py) — from
--overlap on|off, a plan file, the tuning cache, or a short measured search at the first step —
applied to the gradient buckets and the threads' cores, and announced as an `overlap_plan` event.

On a job of several nodes with several ranks each, the search first times the whole gradient
all-reduced by gloo and by the rank-order chain (comm/patterns.py), in interleaved pairs (on one
node of several ranks: by gloo and through shared memory, comm/shm.py); the other is the
collectives of every candidate after when it `leads`. The search times forward + backward +
the bucketed all-reduce of the first step's batch for a few candidates, the job's own bucket size first, then the best buckets' all-reduce after backward
instead of during it; the fastest replaces the default only when it leads again in interleaved
pairs of trials against it (`_duel`, `leads`); into a scratch gradient (the step's own gradient slot and the logged ones are
never touched, no update is applied, buffers and RNG are restored as a redo restores them), so
the run after it is bitwise the run launched with the chosen plan given as a file. Every rank
takes the same choice: the measurements are all-gathered (which also bounds the search's time
collectively) and every rank picks from the same table. The agreed plan goes to the job's store,
where a member that joins later (a shadow taking a rank) reads it.
"""
from __future__ import annotations

import hashlib
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from unbroken.comm import bucketed, shm
from unbroken.fsutil import atomic_write_json
from unbroken.parallel.buckets import GradBuckets
from unbroken.parallel.eager import EagerUpdate
from unbroken.parallel.overlap import (OverlapPlan, Partition, PlanError, ThreadPinner, plan_file_text,
                                       read_plan_file)
from unbroken.runtime import membership
from unbroken.runtime.determinism import FORWARD, seed_everything

CANDIDATE_KB = (256, 1024, 4096, 25600)  # bucket sizes tried (KiB), with the shared partition
TRY_PARTITIONS = ("pinned", "split")  # then these, with the best bucket size
TRIALS = 3  # timed forward/backward/all-reduce runs per candidate, after one untimed warm-up
PROBES = 5  # timed whole-gradient all-reduces per collectives candidate (multi-node jobs)
PROBE_ROUNDS = 3  # rounds of PROBES pairs at most, while the pairs are mixed
DUELS = 4  # interleaved trial pairs of the default against the fastest candidate
BUDGET_S = 30.0  # no new candidate starts once any rank has spent this long searching
STORE_KEY = "overlap/plan"
TIMELINE_STEP = 3  # rank 0 records this step's bucket times (an `overlap_timeline` event): after warm-up


def cache_path(mode: str) -> Path | None:
    """Where the plan lives: FILE for --overlap FILE; for auto $UNBROKEN_CACHE_DIR/overlap.json
    (default ~/.cache/unbroken); None for on/off."""
    if mode in ("on", "off"):
        return None
    if mode != "auto":
        return Path(mode)
    root = os.environ.get("UNBROKEN_CACHE_DIR") or Path.home() / ".cache" / "unbroken"
    return Path(root) / "overlap.json"


def tuning_key(cfg, named: list, nnodes: int) -> dict:
    """What a tuned plan is valid for: the model (its shapes and batch), the world and the wiring."""
    shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named)
    return {"model": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "params": sum(p.numel() for _, p in named), "batch_size": cfg.batch_size,
            "seq_len": cfg.model.seq_len, "world_size": cfg.world_size, "strategy": cfg.strategy,
            "threads": cfg.threads,
            "wiring": f"{nnodes} node(s), backend {cfg.backend}, if {os.environ.get('GLOO_SOCKET_IFNAME', 'default')}"}


def _why_stale(cached: dict, key: dict) -> str | None:
    theirs = cached.get("key") or {}
    diff = [f"{k} {theirs.get(k)!r} (this job: {v!r})" for k, v in key.items() if theirs.get(k) != v]
    return None if not diff else "cached plan was tuned for another job: " + ", ".join(diff)


class OverlapControl:
    def __init__(self, cfg, *, named: list, nnodes: int, local_rank: int, emit) -> None:
        self.cfg, self.local_rank, self.emit, self.nnodes = cfg, local_rank, emit, nnodes
        self.path = cache_path(cfg.overlap)
        self.key = tuning_key(cfg, named, nnodes)
        self.needs_tuning, self.why, self._announced = False, "", False
        self._agreed = cfg.overlap in ("on", "off")  # the same plan everywhere by construction
        self.plan = self._initial()
        self.pinner = ThreadPinner(self.plan.partition, local_rank)

    def _initial(self) -> OverlapPlan:
        mode = self.cfg.overlap
        if mode in ("on", "off"):
            return OverlapPlan(during_backward=mode == "on", bucket_kb=self.cfg.bucket_kb, source=mode)
        try:
            cached = read_plan_file(self.path)
        except PlanError as e:
            if mode != "auto":
                raise  # a plan file the user named: the worker refuses (exit 2)
            cached = {"key": {}, "plan": {}, "error": str(e)}
        if cached is not None and "key" not in cached:
            return OverlapPlan.from_dict(cached["plan"], source="file")  # written by hand: used as given
        stale = ("no cached plan" if cached is None else cached.get("error") or _why_stale(cached, self.key))
        if stale is None:
            return OverlapPlan.from_dict(cached["plan"], source="cache")
        self.needs_tuning, self.why = True, stale
        return OverlapPlan(bucket_kb=self.cfg.bucket_kb, source="default until tuned")

    def adopt_agreed(self, store) -> None:
        """A member joining a running job takes the plan its peers agreed on (if they tuned)."""
        agreed = membership.get(store, STORE_KEY)
        if agreed is not None:
            self._set(OverlapPlan.from_dict(agreed, source="agreed"))
            self.needs_tuning, self._agreed = False, True

    def _agree(self, tr) -> None:
        """One tiny collective at the first step: search if any rank must (or the ranks read
        different plans: files on different hosts), so that every rank issues the same buckets."""
        mine = {"tune": self.needs_tuning, "plan": {k: v for k, v in self.plan.to_dict().items() if k != "source"}}
        everyone = tr.comm.allgather_json(mine, what="overlap plan agreement")
        if any(v["tune"] for v in everyone) and not self.needs_tuning:
            self.needs_tuning, self.why = True, "another rank has no valid cached plan"
        elif any(v["plan"] != mine["plan"] for v in everyone):
            self.needs_tuning, self.why = True, "the ranks read different plans"
        if not self.needs_tuning:  # agreed on a file's or cache's plan: a shadow joining later adopts it
            # every rank writes the same value, not rank 0 alone: the key is there as long as any
            # rank got this far, whichever rank dies next (a store write is one small message)
            membership.put(tr.ctx.store, STORE_KEY, self.plan.to_dict())
        self._agreed = True

    def _set(self, plan: OverlapPlan) -> None:
        if plan.partition != self.plan.partition:
            self.pinner.release()
            self.pinner = ThreadPinner(plan.partition, self.local_rank)
        self.plan = plan

    def before_step(self, tr, t: int, closure) -> None:
        """At the start of every step attempt: tune if due (then the buckets take the chosen size),
        announce the plan once, pin threads started since (a new generation's gloo group)."""
        if not self._agreed:
            self._agree(tr)
        if self.needs_tuning:
            self.tune(tr, t, closure)
            tr.buckets.close()
            tr.buckets = GradBuckets(tr.owned.flat, *self.plan.bucket_sizes)
            tr.eager = EagerUpdate(tr.owned, tr.buckets, tr.world_size)
        self.apply_collectives(tr)
        if not self._announced:
            self._announced = True
            self.announce(t)
        if t == TIMELINE_STEP + 1 and tr.rank == 0 and tr.buckets.timeline is not None:
            tl = tr.buckets.timeline
            self.emit("overlap_timeline", step=t - 1, backward_s=round(tl["backward_s"], 5),
                      eager_chunks=tr.eager.last_kept, chunks=tr.owned.state.n_chunks,
                      end_s=round(tl["end_s"], 5), buckets=[[round(a, 5), None if b is None else round(b, 5)]
                                                           for a, b in tl["buckets"]])
        self.pinner.refresh()

    def collectives(self) -> str:
        """The gradient all-reduce of this job: the plan's choice, else --collectives."""
        return self.plan.collectives or self.cfg.collectives

    def apply_collectives(self, tr) -> None:
        """Give the trainer the gradient all-reduce the plan names (every rank holds the same plan:
        they all switch before the same step)."""
        mode = self.collectives()
        if _mode_of(tr) != mode:
            if tr.ours is not None:
                tr.ours.close()
            tr.ours = _ours(tr, mode)

    def collectives_worth_trying(self, tr) -> str | None:
        """The collectives to time against gloo's own, for a gradient all-reduced whole (ddp, zero1)
        on the host under the gloo default: the rank-order chain on several nodes of several ranks
        each (it halves what crosses the node links), shared memory on one node of several ranks
        (no bytes through TCP loopback; where the host's store order allows it); None otherwise."""
        if self.cfg.collectives != "gloo" or self.cfg.strategy not in ("ddp", "zero1") or tr.comm.dev_pg is not None:
            return None
        if self.nnodes > 1 and tr.world_size > self.nnodes:
            return "chain"
        return "shm" if self.nnodes == 1 and tr.world_size > 1 and shm.usable_here() else None

    def announce(self, step: int) -> None:
        p = self.plan
        self.emit("overlap_plan", step=step, mode=self.cfg.overlap, source=p.source, bucket_kb=p.bucket_kb,
                  collectives=self.collectives(),
                  first_bucket_kb=p.first_bucket_kb, eager_update=p.eager_update, during_backward=p.during_backward, partition=p.partition.to_json(),
                  compute_cores=sorted(self.pinner.compute) if self.pinner.compute is not None else None,
                  comm_cores=sorted(self.pinner.comm) if self.pinner.comm is not None else None,
                  compute_threads=torch.get_num_threads(), reason=self.why or None)

    # --- the search ----------------------------------------------------------------------------
    def tune(self, tr, t: int, closure) -> None:
        """Measure candidates on step t's batch, agree, apply, cache. Raises CollectiveError."""
        scratch = torch.empty_like(tr.owned.flat.grads)
        table: list[dict] = []
        started = time.perf_counter()
        measure = lambda cand: self._measure(tr, t, closure, scratch, cand, table, started)  # noqa: E731
        alt = self.collectives_worth_trying(tr)
        probe = self._probe_collectives(tr, scratch, alt) if alt else None
        coll = probe["chosen"] if probe else None
        default_kb = self.cfg.bucket_kb  # measured first: every other candidate has to beat it
        go = measure(OverlapPlan(bucket_kb=default_kb, collectives=coll))
        for kb in (k for k in CANDIDATE_KB if k != default_kb):
            if not (go := go and measure(OverlapPlan(bucket_kb=kb, collectives=coll))):
                break
        best = _fastest(table)
        for name in TRY_PARTITIONS:
            if not (go := go and measure(OverlapPlan(bucket_kb=best["bucket_kb"], partition=Partition(name=name),
                                                     collectives=coll))):
                break
        best = _fastest(table)  # then the same buckets all-reduced after backward: on shared cores the
        if go:  # hooks' all-reduces compete with backward
            measure(replace(_plan_of(best), during_backward=False))
        best, duel = _fastest(table), None
        if best is not table[0]:  # a lead of three trials in a row is confirmed in pairs, or dropped
            duel = self._duel(tr, t, closure, scratch, table[0], best)
            best = best if duel["kept"] == "fastest" else table[0]
        plan = replace(_plan_of(best), source="tuned")
        self.pinner.release()
        self.plan, self.pinner = plan, ThreadPinner(plan.partition, self.local_rank)
        self.pinner.refresh()
        membership.put(tr.ctx.store, STORE_KEY, plan.to_dict())
        self.needs_tuning = False
        measured = {"candidates": table, "collectives_probe": probe, "duel": duel,
                    "search_s": round(time.perf_counter() - started, 3)}
        tr.ctx.events.emit("overlap_tuned", step=t, chosen=plan.to_dict(), reason=self.why, **measured)
        if tr.rank == 0:
            atomic_write_json(self.path, plan_file_text(plan, self.key, measured))

    def _probe_collectives(self, tr, scratch: torch.Tensor, alt: str) -> dict:
        """The job's all-reduce against `alt` on the whole gradient alone (interleaved, one
        warm-up, PROBES timed pairs): a collective's difference is a few per cent of a trial's
        forward + backward and drowns in its spread, not in the collective's own. The times are
        every rank's mean per probe; `alt` is kept when it `leads`. Mixed pairs (neither leads)
        are probed again, up to PROBE_ROUNDS, and the last round decides: a transient stall of
        the host lands in a few pairs of one round (at 1 Gbit/s the chain once took 0.27-0.32 s
        in three pairs and 0.12 s in two, against gloo's 0.15-0.19 s, and gloo was kept)."""
        own = self.cfg.collectives
        comms = {own: tr.ours or tr.comm, alt: _ours(tr, alt)}
        rounds: list[dict[str, list[float]]] = []
        try:
            for _ in range(PROBE_ROUNDS):
                mean = self._probe_round(tr, comms, scratch, warm_up=not rounds)
                rounds.append({m: [round(x, 5) for x in v] for m, v in mean.items()})
                if leads(mean[own], mean[alt]) or leads(mean[alt], mean[own]):
                    break
        finally:
            comms[alt].close()
        return {"seconds": rounds[-1], "rounds": rounds, "chosen": alt if leads(mean[own], mean[alt]) else None}

    def _probe_round(self, tr, comms: dict, scratch: torch.Tensor, warm_up: bool) -> dict[str, list[float]]:
        """PROBES interleaved whole-gradient all-reduces of each of `comms`: every rank's mean per probe."""
        times: dict[str, list[float]] = {m: [] for m in comms}
        scratch.zero_()
        for i in range(PROBES + warm_up):
            for m, c in comms.items():
                t0 = time.perf_counter()
                c.finish(c.allreduce_start(scratch, what=f"overlap tuning: {m} all-reduce"))
                if i >= warm_up:
                    times[m].append(time.perf_counter() - t0)
        everyone = tr.comm.allgather_json(times, what="overlap tuning: collectives")
        return {m: [statistics.fmean(r[m][i] for r in everyone) for i in range(PROBES)] for m in comms}

    def _times(self, tr, t, closure, scratch, cand: OverlapPlan, n: int, warm_up: bool = True) -> list[float]:
        """Seconds of `n` trials of `cand` on this rank (after one untimed warm-up if `warm_up`)."""
        self.pinner.release()  # the previous candidate's (or the start's) cores
        self.pinner = ThreadPinner(cand.partition, self.local_rank)
        self.pinner.refresh()
        buckets = GradBuckets(tr.owned.flat, *cand.bucket_sizes)
        mode = cand.collectives or self.cfg.collectives
        own = _mode_of(tr) == mode
        comm = (tr.ours or tr.comm) if own else (_ours(tr, mode) or tr.comm)  # a trial's own, closed after
        times = []
        try:
            for i in range(n + warm_up):
                t0 = time.perf_counter()
                _trial(tr, buckets, comm, t, closure, scratch, during_backward=cand.during_backward)
                if i >= warm_up:
                    times.append(time.perf_counter() - t0)
        finally:
            buckets.close()
            if not own and comm is not tr.comm:
                comm.close()
        return times

    def _measure(self, tr, t, closure, scratch, cand: OverlapPlan, table: list, started: float) -> bool:
        """Time one candidate on every rank; append the ranks' mean to `table`. False: out of time."""
        times = self._times(tr, t, closure, scratch, cand, TRIALS)
        mine = {"step_s": statistics.median(times), "spread_s": max(times) - min(times),
                "elapsed_s": time.perf_counter() - started}
        everyone = tr.comm.allgather_json(mine, what="overlap tuning measurements")
        table.append({"bucket_kb": cand.bucket_kb, "partition": cand.partition.to_json(),
                      "during_backward": cand.during_backward, "collectives": cand.collectives,
                      "step_s": round(statistics.fmean(r["step_s"] for r in everyone), 5),
                      "spread_s": round(statistics.fmean(r["spread_s"] for r in everyone), 5)})
        return max(r["elapsed_s"] for r in everyone) < BUDGET_S

    def _duel(self, tr, t, closure, scratch, base: dict, other: dict) -> dict:
        """The default row and the fastest one, in DUELS interleaved pairs of trials (after one
        warm-up of each): three trials of a candidate in a row can all land in a slow patch of
        the machine, a pair's two trials share it. `other` is kept when it `leads`."""
        plans = [_plan_of(base), _plan_of(other)]
        for p in plans:
            self._times(tr, t, closure, scratch, p, 0)
        times: list[list[float]] = [[], []]
        for _ in range(DUELS):
            for k, p in enumerate(plans):
                times[k] += self._times(tr, t, closure, scratch, p, 1, warm_up=False)
        everyone = tr.comm.allgather_json(times, what="overlap tuning: the default against the fastest")
        mean = [[statistics.fmean(r[k][i] for r in everyone) for i in range(DUELS)] for k in (0, 1)]
        return {"default_s": [round(x, 5) for x in mean[0]], "fastest_s": [round(x, 5) for x in mean[1]],
                "kept": "fastest" if leads(mean[0], mean[1]) else "default"}


def _plan_of(row: dict) -> OverlapPlan:
    return OverlapPlan(bucket_kb=row["bucket_kb"], partition=Partition.from_json(row["partition"]),
                       during_backward=row.get("during_backward", True), collectives=row.get("collectives"))


def leads(base: list[float], other: list[float]) -> bool:
    """Interleaved pairs (base_i, other_i): `other` leads when it was faster in all pairs but at
    most one and its median lead is over 5 % of base's median. Pairs, not ranges: the machine's
    noise moves both of a pair alike (a range rule missed a 25 % lead of the chain at 1 Gbit/s
    when one probe of five was slow, and kept one 25 MB bucket against 1 MB buckets 26 % faster)."""
    lead = [a - b for a, b in zip(base, other)]
    return sum(d > 0 for d in lead) >= len(lead) - 1 and statistics.median(lead) > 0.05 * statistics.median(base)


def _fastest(table: list[dict]) -> dict:
    """The row of least median trial time (the default, table[0], on a tie)."""
    return min(table, key=lambda r: r["step_s"])


def _mode_of(tr) -> str:
    """The collectives the trainer's gradient all-reduce runs now."""
    return tr.ours.mode if tr.ours is not None else "gloo"


def _ours(tr, mode: str):
    """A BucketedAllreduce of `mode` on the trainer's group (None for gloo's own)."""
    gen = tr.gen.gen
    return bucketed.for_comm(tr.comm, mode, emit=tr.ctx.events.emit, interrupted=lambda: tr.watch.newer_than(gen))


def _trial(tr, buckets: GradBuckets, comm, t: int, closure, scratch: torch.Tensor, during_backward: bool = True) -> None:
    """Forward and backward of step t with `buckets` issuing into `scratch` over `comm` (during
    backward, or all of them after it); nothing kept."""
    flat = tr.owned.flat
    flat.zero_grad()
    tr.model_buffers.restore()  # as a redo: the step's forward starts from the committed buffers
    n = tr.accumulation_steps
    for i in range(n):
        seed_everything(tr.cfg.seed, t, tr.rank, FORWARD + i)
        loss = tr._call(closure, i)
        if i < n - 1:
            loss.backward()
    if not during_backward:
        loss.backward()
        scratch.copy_(flat.grads)
        buckets.issue_all(comm, scratch, what=f"overlap tuning step {t} (after backward)")
        flat.zero_grad()
        return
    buckets.begin(comm, scratch, scratch, 0.0, poison=False, what=f"overlap tuning step {t}")
    loss.backward()
    buckets.finish()
    flat.zero_grad()


def overlap_control(tr) -> OverlapControl:
    """The Trainer's control; a bad plan file stops the job with its one-line error (exit 2)."""
    try:
        return OverlapControl(tr.cfg, named=tr.named, nnodes=tr.ctx.nnodes,
                              local_rank=int(os.environ.get("LOCAL_RANK", "0")), emit=tr.ctx.events.emit)
    except PlanError as e:
        tr._refuse(str(e))


def checked_overlap(cfg):
    """At launch: a plan file's path made absolute (the workers' working directory may differ) and
    its contents checked (a bucket size <= 0, cores the machine lacks: PlanError, exit 2); the config
    and the plan file's JSON (None without a plan file, or with one not written yet)."""
    if cfg.overlap in ("on", "off", "auto"):
        return cfg, None
    path = Path(cfg.overlap).resolve()
    return cfg.replace(overlap=str(path)), read_plan_file(path)
