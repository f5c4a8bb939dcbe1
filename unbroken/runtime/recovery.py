"""In-place recovery: survivors and new members agree on a version and rebuild state.

Run by every member of a new generation right after joining it (survivors from
inside their interrupted step, new members from the shadow's wait):
1. exchange status (committed step, which step's gradient each holds, versions);
2. target T: the interrupted step if any survivor holds its averaged gradient
   (roll forward), else the last committed step (the interrupted step is redone);
3. rebuild new members: replicated state is broadcast from a survivor; a sharded
   shard is decoded from tier-1 parity at the versions the parity reflects;
4. roll every chunk forward to T, rebuild parity, all-gather parameters.
If tier 1 cannot decode (two losses in one parity group, a version no longer
reachable), every rank restores the newest valid tier-2 checkpoint instead.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from unbroken.protect.tier1 import CorruptParity
from unbroken.protect.txn import UnrecoverableChunk
from unbroken.runtime import membership

if TYPE_CHECKING:
    from unbroken.runtime.worker import Trainer


class RecoveryFailed(RuntimeError):
    """Neither tier 1 nor tier 2 can restore the job's state."""


def recover(tr: "Trainer", *, new_member: bool) -> None:
    """Bring this process into the newest generation with state at an agreed version."""
    from unbroken.comm.group import CollectiveError

    ctx = tr.ctx
    ctx.set_phase("recovery")
    while True:  # a failure during recovery (or a newer generation) moves everyone on
        try:
            t0 = time.time()
            tr._join(membership.wait_newer_generation(ctx.store, tr.gen.gen if tr.gen else -1,
                                                      tr.cfg.collective_timeout_s, tr.watch))
            if tr.gen.members.get(tr.rank) != ctx.proc:
                raise RecoveryFailed(f"{ctx.proc} is no longer rank {tr.rank} in generation {tr.gen.gen}")
            _phase(tr, "regroup", t0)
            if tr.has_state:
                tr._point("recovery", tr.step_count + 1)
            tr.deferred = None  # a decode deferred by an earlier generation is void now
            _rebuild(tr, new_member=not tr.has_state)
            if tr.deferred is None:
                tr.has_state = True
            # else: a new member gets its state in finish_deferred_decode (first step)
            return
        except CollectiveError as e:
            ctx.set_phase("recovery")
            tr._report_collective_error(tr.step_count + 1, e)


def reporter(tr: "Trainer") -> bool:
    """One member reports the recovery's phases: the lowest-ranked survivor (the lowest rank
    when every member is new)."""
    kept = [r for r in tr.gen.members if r not in tr.gen.replaced]
    return tr.rank == min(kept or tr.gen.members)


def _phase(tr: "Trainer", name: str, start: float) -> None:
    if reporter(tr):
        tr.ctx.events.emit("recovery_phase", phase=name, start=start, end=time.time(), step=tr.step_count + 1)


def _rebuild(tr: "Trainer", new_member: bool) -> None:
    t0 = time.time()
    tr.parity_rebuilt = None
    owned, comm = tr.owned, tr.comm
    mine = {"rank": tr.rank, "new": new_member, "committed": tr.step_count, "grads_step": tr.grads_step,
            "local_step": tr.local_step,
            "parity_ver": owned.txn.parity_ver.tolist() if not new_member else None}
    status = comm.allgather_object(mine, what="recovery status")
    survivors = [s for s in status if not s["new"]]
    new_ranks = [s["rank"] for s in status if s["new"]]
    if not survivors:
        raise RecoveryFailed("every rank of the job was lost at once; restart from a tier-2 checkpoint")
    c_max = max(s["committed"] for s in survivors)
    holders = [s["rank"] for s in survivors if s["grads_step"] == c_max + 1]
    target = c_max + 1 if holders else c_max
    if holders:
        comm.broadcast(owned.flat.grads, src=min(holders), what="gradient hand-off")
        tr.grads_step = target
        tr.scalars = tr.optim.scalars(target, float(torch.linalg.vector_norm(owned.flat.grads[:owned.flat.n_pad])))
        tr.last_loss = float(owned.flat.grads[-1])
    src = min(s["rank"] for s in survivors)
    if owned.sharded and owned.tier1 is not None:
        path = _rebuild_sharded(tr, status, new_ranks, target, src, redo=not holders)
    else:
        path = _rebuild_replicated(tr, new_member, target, src)
    _phase(tr, "rebuild", t0)
    if path == "tier2":
        return
    tr.step_count = target
    tr.redo_since = time.time()  # the first step completed from here closes the `redo` phase
    if reporter(tr):
        secs = time.time() - t0
        nbytes = owned.state.n_chunks * owned.state.chunk_bytes * len(new_ranks)
        kept = [s["rank"] for s in survivors if s.get("local_step") == target + 1]
        tr.ctx.events.emit("recovered", step=target, steps_lost=0, steps_redone=0 if holders else 1, path=path,
                           parity_rebuilt=tr.parity_rebuilt,
                           # on a redo, survivors that kept their own gradient skip forward/backward
                           recompute_ranks=[] if holders else sorted(set(range(tr.world_size)) - set(kept)),
                           replaced=new_ranks, rebuild_s=round(secs, 4), rebuilt_bytes=nbytes,
                           rebuild_gbps=round(nbytes / secs / 1e9, 3))


def _rebuild_replicated(tr: "Trainer", new_member: bool, target: int, src: int) -> str:
    owned = tr.owned
    if not new_member and tr.grads_step == target and target > 0:
        owned.roll_forward(tr.scalars)
    for name, t in (("parameters", owned.flat.params), ("adam m", owned.m), ("adam v", owned.v)):
        tr.comm.broadcast(t, src=src, what=f"replica hand-off of {name}")
    owned.txn.chunk_ver[:] = target
    return "replica"


def _rebuild_sharded(tr: "Trainer", status: list[dict], new_ranks: list[int], target: int, src: int,
                     redo: bool) -> str:
    owned, k = tr.owned, tr.owned.k
    lost_by_group: dict[int, list[int]] = {}
    for r in new_ranks:
        lost_by_group.setdefault(r // k, []).append(r)
    can = all(len(v) == 1 for v in lost_by_group.values())
    if target == 0:
        # Nothing was ever updated: everyone holds the initial parameters; moments are zero.
        tr.comm.broadcast(owned.flat.params, src=src, what="initial parameter hand-off")
        if tr.rank in new_ranks:
            owned.m.zero_()
            owned.v.zero_()
            owned.txn.chunk_ver[:] = 0
        owned.tier1.build(tr.group, 0)
        return "initial"
    mine_lost = lost_by_group.get(tr.rank // k, [])
    # When every survivor's parity reflects `target` (the interrupted step changed no chunk, the
    # usual case for a failure before the update), survivors' parity stays valid: only the lost
    # member's own parity rows are rebuilt, and they ride in the decode's reduce (slot k-1).
    fresh = all(v == target for st in status if not st["new"] for v in st["parity_ver"])
    if fresh and can and redo:
        return _rebuild_overlapped(tr, status, lost_by_group, target)
    ok, buf, pv = True, None, None
    if can and mine_lost:
        try:
            pv, buf = _decode_input(tr, status, mine_lost[0], rows=fresh)
        except UnrecoverableChunk as e:
            tr.ctx.events.emit("warning", message=f"tier 1 cannot decode rank {mine_lost[0]}: {e}")
            ok = False
    # Everyone must agree before the decode collective: one rank unable means tier 2.
    flag = torch.tensor([0 if (can and ok) else 1], dtype=torch.int32)
    tr.comm.allreduce(flag, what="tier-1 feasibility vote")
    if int(flag) != 0:
        return _restore_tier2(tr, reason="tier 1 cannot decode (two losses in a parity group or a lost version)")
    lost = mine_lost[0] if mine_lost else None
    if lost is not None:
        tr.group.reduce(buf, dst=lost % k, op=dist.ReduceOp.BXOR, what=f"tier-1 decode of rank {lost}")
    if not _install_and_vote(tr, buf, pv, lost, target, rows=fresh):
        return _restore_tier2(tr, reason="a tier-1 decoded chunk failed its checksum (corrupted parity or data)")
    if tr.grads_step == target:
        owned.roll_forward(tr.scalars)
    behind = [int(v) for v in set(owned.txn.chunk_ver.tolist()) if v != target]
    assert not behind, f"rank {tr.rank}: chunks at versions {behind} after roll-forward to {target}"
    if not fresh:
        owned.tier1.build(tr.group, target)
    owned.commit(tr.comm)
    tr.parity_rebuilt = "lost rows" if fresh else "full"
    return "tier1"


def _rebuild_overlapped(tr: "Trainer", status: list[dict], lost_by_group: dict[int, list[int]], target: int) -> str:
    """The common case, a failure before the update: nothing changed in step target+1.

    Every chunk and parity chunk is at `target`, so decoding cannot fail for lack of a
    version, and a survivor that committed `target` holds all parameters at it. One
    broadcast gives every rank those parameters (the new member can start its forward at
    once); the decode (plus the lost member's parity rows) is only *issued* here and runs on
    gloo's threads while the new member computes its share of the redone step. The new
    member installs it, and all ranks vote on its checksums, in `finish_deferred_decode`
    just before the step's gradient all-reduce. Until then the new member holds no state.
    """
    owned, k = tr.owned, tr.owned.k
    src = min(s["rank"] for s in status if not s["new"] and s["committed"] == target)
    tr.comm.broadcast(owned.flat.params, src=src, what="parameter hand-off")
    tr.deferred = {}  # not None: the checksum vote is due (every rank votes, lost member or not)
    mine_lost = lost_by_group.get(tr.rank // k, [])
    if mine_lost:
        lost = mine_lost[0]
        pv, buf = _decode_input(tr, status, lost, rows=True)
        pending = tr.group.reduce_start(buf, dst=lost % k, op=dist.ReduceOp.BXOR, what=f"tier-1 decode of rank {lost}")
        tr.deferred.update(pending=pending, buf=buf, pv=pv, lost=lost, target=target)
    tr.parity_rebuilt = "lost rows"
    return "tier1"


def _decode_input(tr: "Trainer", status: list[dict], lost: int, *, rows: bool) -> tuple[list, torch.Tensor]:
    """(parity versions of lost's group, this rank's decode buffer): k-1 slots of the lost
    member's chunks, plus slot k-1 for its parity rows when `rows`. The lost member's own
    buffer stays zero (the reduce's destination). Raises UnrecoverableChunk."""
    owned, k = tr.owned, tr.owned.k
    first = (tr.rank // k) * k
    pv = [status[first + s]["parity_ver"] for s in range(k)]
    buf = torch.zeros((owned.layout.n_windows, k if rows else k - 1, *owned.state.chunk_shape), dtype=torch.int32)
    if tr.rank != lost:
        owned.tier1.decode_contribution(lost % k, pv, out=buf[:, :k - 1])
        if rows:
            owned.tier1.row_contribution(lost % k, buf[:, k - 1])
    return pv, buf


class RolledBack(Exception):
    """A deferred decode failed its checksums: the job went back to a tier-2 checkpoint."""


def finish_deferred_decode(tr: "Trainer") -> None:
    """Complete `_rebuild_overlapped`: the new member installs its decoded state; all vote."""
    d, tr.deferred = tr.deferred, None
    if "pending" in d:
        tr.group.finish(d["pending"])
    if not _install_and_vote(tr, d.get("buf"), d.get("pv"), d.get("lost"), d.get("target"), rows=True):
        _restore_tier2(tr, reason="a tier-1 decoded chunk failed its checksum (corrupted parity or data)")
        tr.has_state = True
        raise RolledBack(f"restored tier-2 checkpoint of step {tr.step_count}")
    tr.has_state = True


def _install_and_vote(tr: "Trainer", buf: torch.Tensor | None, pv: list | None, lost: int | None,
                      target: int | None, *, rows: bool) -> bool:
    """The new member `lost` installs what the decode delivered (its chunks, and its parity
    rows when `rows`), each chunk checked against its CRC; then every rank votes. True when
    every install passed (a rank with nothing to install votes yes)."""
    owned, k, bad = tr.owned, tr.owned.k, None
    if lost is not None and tr.rank == lost:
        try:
            owned.tier1.install_decoded(buf[:, :k - 1], pv)
            if rows:
                owned.tier1.install_parity(buf[:, k - 1], target)
        except CorruptParity as e:
            bad = str(e)
            tr.ctx.events.emit("warning", message=f"rank {lost}: {e}")
    flag = torch.tensor([1 if bad else 0], dtype=torch.int32)
    tr.comm.allreduce(flag, what="tier-1 checksum vote")
    return int(flag) == 0


def _restore_tier2(tr: "Trainer", *, reason: str) -> str:
    from unbroken.protect.tier2 import latest_valid_step, load_checkpoint

    owned, cfg = tr.owned, tr.cfg
    sharded = owned.sharded
    directory = tr.ctx.run_dir / "checkpoints"
    world = tr.world_size if sharded else 1
    if tr.ckpt is not None:
        tr.ckpt.wait(timeout=cfg.collective_timeout_s)  # our own pending write lands first
    mine = latest_valid_step(directory, world_size=world, run_id=tr.ctx.run_dir.name, events=tr.ctx.events) \
        if directory.exists() else None
    agreed = torch.tensor([-1 if mine is None else mine], dtype=torch.int64)
    tr.comm.allreduce(agreed, op=dist.ReduceOp.MIN, what="tier-2 step agreement")
    step = None if int(agreed) < 0 else int(agreed)
    if step is None:
        raise RecoveryFailed(f"{reason}, and no valid tier-2 checkpoint exists; "
                             f"enable checkpoint_every (now {cfg.checkpoint_every}) to survive this")
    tr.ctx.events.emit("tier2_restore", step=step, reason=reason)
    tensors, _meta = load_checkpoint(directory, step, rank=tr.rank if sharded else 0, world_size=world,
                                     run_id=tr.ctx.run_dir.name)
    owned.load(tensors, step)
    if owned.tier1 is not None:
        owned.tier1.build(tr.group, step)
    owned.commit(tr.comm)
    tr.grads_step = None
    tr.step_count = step
    return "tier2"
