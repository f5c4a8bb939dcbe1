"""In-place recovery: survivors and new members agree on a version and rebuild state.

Run by every member of a new generation right after joining it (survivors from
inside their interrupted step, new members from the shadow's wait):
1. exchange status (committed step, which step's gradient each holds, versions);
2. target T: the interrupted step if any survivor holds its averaged gradient
   (roll forward), else the last committed step (the interrupted step is redone);
3. rebuild new members: replicated state is broadcast from a survivor; a sharded
   shard is decoded from tier-1 parity at the versions the parity reflects;
4. replay every chunk forward to T (from the parity point, with the logged gradients
   and scalars), rebuild parity if a parity step was cut short, all-gather parameters.
If tier 1 cannot decode (two losses in one parity group, a version no longer
reachable), every rank restores the newest valid tier-2 checkpoint instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from unbroken.comm.group import CollectiveError, Pending
from unbroken.protect.tier1 import CorruptParity
from unbroken.protect.txn import StepScalars, UnrecoverableChunk
from unbroken.runtime import crash, membership
from unbroken.runtime.state import RecoveryInputs
from unbroken.runtime.zero2_recovery import hand_parameters_at, region_sources, update_done



class RecoveryFailed(RuntimeError):
    """This process cannot take part in the recovery (e.g. it is no longer a member)."""


class Unrecoverable(RecoveryFailed):
    """Neither tier 1 nor tier 2 can restore the job's state: the job stops (exit 1)."""


def recover(tr: RecoveryInputs, *, new_member: bool) -> None:
    """Bring this process into the newest generation with state at an agreed version."""
    ctx = tr.ctx
    ctx.set_phase("recovery")
    while True:  # a failure during recovery (or a newer generation) moves everyone on
        try:
            t0 = time.time()
            gen = membership.wait_newer_generation(ctx.store, tr.gen.gen if tr.gen else -1,
                                                   tr.cfg.collective_timeout_s, tr.watch)
            if gen.members.get(tr.rank) != ctx.proc:  # replaced (e.g. its node was declared lost):
                # never connect to a generation as a rank someone else now holds
                raise RecoveryFailed(f"{ctx.proc} is no longer rank {tr.rank} in generation {gen.gen}")
            tr.join(gen)
            _phase(tr, "regroup", t0)
            if tr.st.has_state:
                tr.point("recovery", tr.st.step_count + 1)
            tr.st.deferred = None  # a decode deferred by an earlier generation is void now
            _rebuild(tr, new_member=not tr.st.has_state)
            if tr.st.deferred is None:
                tr.st.has_state = True
            # else: a new member gets its state in finish_deferred_decode (first step)
            return
        except CollectiveError as e:
            ctx.set_phase("recovery")
            tr.report(tr.st.step_count + 1, e)


def reporter(tr: RecoveryInputs) -> bool:
    """One member reports the recovery's phases: the lowest-ranked survivor (the lowest rank
    when every member is new)."""
    kept = [r for r in tr.gen.members if r not in tr.gen.replaced]
    return tr.rank == min(kept or tr.gen.members)


def _phase(tr: RecoveryInputs, name: str, start: float) -> None:
    if reporter(tr):
        tr.ctx.events.emit("recovery_phase", phase=name, start=start, end=time.time(), step=tr.st.step_count + 1)


def _status(tr: RecoveryInputs, new_member: bool) -> dict:
    """What this member tells the others at the start of a recovery."""
    owned = tr.owned
    scalars = tr.st.scalars if tr.st.grads_step is not None else None
    mine = {"rank": tr.rank, "new": new_member, "committed": tr.st.step_count, "grads_step": tr.st.grads_step,
            "local_step": tr.st.local_step, "gathering": tr.st.gathering_step, "chunks": None,
            "parity_ver": None, "snap_ver": None, "next_parity": None,
            "log_from": None, "history": [],
            # the scalars computed with the averaged gradient (hyperparameters as the holder's groups had them)
            "scalars": scalars.to_list() if scalars is not None and scalars.step == tr.st.grads_step else None}
    if not new_member:
        mine.update(parity_ver=owned.txn.parity_ver.tolist(), snap_ver=owned.txn.snap_ver,
                    chunks=[int(owned.txn.chunk_ver.min()), int(owned.txn.chunk_ver.max())],
                    next_parity=owned.next_parity, log_from=owned.log_from, protect_every=owned.protect_every,
                    tuned=tr.tuner.done,
                    history=[s.to_list() for s in owned.txn.history.values()])
    return mine


def _rebuild(tr: RecoveryInputs, new_member: bool) -> None:
    t0 = time.time()
    tr.st.parity_rebuilt = None
    owned, comm = tr.owned, tr.comm
    status = comm.allgather_json(_status(tr, new_member), what="recovery status")
    survivors = [s for s in status if not s["new"]]
    new_ranks = [s["rank"] for s in status if s["new"]]
    if not survivors:  # every rank lost at once (a whole job's nodes): only tier 2 holds the state
        _restore_tier2(tr, reason="every rank of the job was lost at once")
        _phase(tr, "rebuild", t0)
        return
    if new_member:  # the survivors' protection interval (it may have been chosen by "auto")
        owned.protect_every, tr.tuner.done = survivors[0]["protect_every"], survivors[0]["tuned"]
    c_max = max(s["committed"] for s in survivors)
    holders = [s["rank"] for s in survivors if s["grads_step"] == c_max + 1]
    if owned.sharded_grads and holders and not update_done(survivors, c_max + 1):
        holders = []  # zero2 mid-update: no one holds the lost shard's gradient; the step is redone
    target = c_max + 1 if holders else c_max
    if holders:
        # zero2 hands off only the tail (loss, buffers): its update is done everywhere
        grads = owned.flat.use_grads_of(target)[owned.flat.n_pad if owned.sharded_grads else 0:]
        comm.broadcast(grads, src=min(holders), what="gradient hand-off")
        tr.st.grads_step = target
        tr.st.last_loss = float(owned.flat.grads[owned.flat.loss])
        tr.st.scalars = StepScalars.from_list(status[min(holders)]["scalars"])  # as the holders computed them
        owned.txn.record(tr.st.scalars)
    src = _state_source(survivors, target, handed_off=bool(holders))
    if src is None:
        path = _restore_tier2(tr, reason=f"no survivor can bring its state to step {target}")
    elif owned.sharded_params and any(s["chunks"][1] > target for s in survivors):
        path = _zero3_update_cut_short(tr, status, survivors, new_ranks, target, src)
    elif owned.sharded_grads and owned.tier1 is not None and any(s["chunks"][1] > target for s in survivors):
        path = _rebuild_redo_kept(tr, status, new_ranks, target)
    elif owned.sharded and owned.tier1 is not None:
        path = _rebuild_sharded(tr, status, new_ranks, target, src, redo=not holders)
    elif owned.sharded and owned.world > 1:
        path = _rebuild_unprotected_shards(tr, new_ranks, target)
    else:
        path = _rebuild_replicated(tr, new_member, target, src)
    if path != "tier2":
        _sync_buffers(tr, target, src, handed_off=bool(holders))
    _phase(tr, "rebuild", t0)
    if path == "tier2":
        return
    tr.st.step_count = target
    tr.st.redo_since = time.time()  # the first step completed from here closes the `redo` phase
    if reporter(tr):
        secs = time.time() - t0
        nbytes = owned.state.n_chunks * owned.state.chunk_bytes * len(new_ranks)
        kept = [s["rank"] for s in survivors if s.get("local_step") == target + 1]
        # 0 by construction (target >= c_max); what a tier-2 rollback loses is measured from
        # the events (detect.report.steps_lost_by_gen)
        tr.ctx.events.emit("recovered", step=target, steps_lost=max(0, c_max - target),
                           steps_redone=0 if holders else 1, path=path, parity_rebuilt=tr.st.parity_rebuilt,
                           steps_replayed=tr.st.steps_replayed,
                           # on a redo, survivors that kept their own gradient skip forward/backward
                           recompute_ranks=[] if holders else sorted(set(range(tr.world_size)) - set(kept)),
                           replaced=new_ranks, rebuild_s=round(secs, 4), rebuilt_bytes=nbytes,
                           rebuild_gbps=round(nbytes / secs / 1e9, 3))


def _zero3_update_cut_short(tr: RecoveryInputs, status: list[dict], survivors: list[dict], new_ranks: list[int],
                            target: int, src: int) -> str:
    """zero3 (and fsdp), step target+1 cut short inside its update. No rank keeps a full copy of the
    parameters (nor its local gradient), so the redone step starts from the state of `target`
    everywhere: while no parity window has absorbed the step anywhere, the parity and every
    survivor's snapshot still hold that state (the survivors roll back to it, the lost shard
    is decoded at it) and the step is redone as after a kill before the update; once a window
    has, the lost shard's values of `target` exist nowhere: tier 2."""
    if any(s["snap_ver"] != target or set(s["parity_ver"]) != {target} for s in survivors):
        return _restore_tier2(tr, reason=f"{tr.owned.strategy}: step {target + 1} was cut short inside its update after parity "
                                         f"absorbed part of it: no copy of the parameters of step {target} is left")
    if tr.st.has_state:
        tr.owned.roll_back_to_snapshot()
    return _rebuild_sharded(tr, status, new_ranks, target, src, redo=True)


def _state_source(survivors: list[dict], target: int, *, handed_off: bool) -> int | None:
    """The survivor whose state is at `target` once it has replayed what it holds (the lowest
    rank of those that committed `target`, else of those one step behind that hold target's
    averaged gradient, their own or `handed_off`); None if there is none.

    Never simply the lowest rank: a survivor can be a step behind its peers (its wait for a
    collective failed after theirs completed), and its state broadcast would undo their
    step. With the target rule of `_rebuild` there is always one (the survivor that committed
    c_max; on a hand-off, every survivor is at c_max = target-1); if a future rule breaks
    that, every rank sees the same status and goes to tier 2 together.
    """
    at = [s["rank"] for s in survivors if s["committed"] == target]
    behind = [s["rank"] for s in survivors if s["committed"] == target - 1 and target > 0
              and (handed_off or s["grads_step"] == target)]
    return min(at) if at else min(behind) if behind else None


def _sync_buffers(tr: RecoveryInputs, target: int, src: int, *, handed_off: bool) -> None:
    """Model buffers at `target`: rank 0's of step target travelled in its gradient all-reduce
    (`handed_off`: every member holds that gradient now); else the committed ones of `src`."""
    owned = tr.owned
    if not owned.buffers.words:
        return
    if handed_off:
        owned.buffers.commit(owned.flat.grads_of(target)[owned.flat.buffers])
    else:
        tr.comm.broadcast(owned.buffers.committed, src=src, what="model buffer hand-off")
        owned.buffers.restore()


def _rebuild_replicated(tr: RecoveryInputs, new_member: bool, target: int, src: int) -> str:
    """Every rank owns all of the state (ddp, or one rank): `src`, brought to `target` by its
    own replay, broadcasts it; a survivor a step behind without the gradient is overwritten."""
    owned = tr.owned
    tr.st.steps_replayed = 0
    if not new_member and tr.st.grads_step == target and target > 0:
        owned.replay_to(target)
    for name, t in owned.tensors().items():
        if name != "buffers":  # those follow in _sync_buffers
            tr.comm.broadcast(t, src=src, what=f"replica hand-off of {name}")
    owned.txn.chunk_ver[:] = target
    return "replica"


def _rebuild_unprotected_shards(tr: RecoveryInputs, new_ranks: list[int], target: int) -> str:
    """zero1 without tier 1: a lost shard exists nowhere else, so a new member means tier 2.
    Without one (a link regroup), each survivor replays its own shard to `target` (it holds
    the gradient: its own or the hand-off) and the parameters are all-gathered."""
    owned = tr.owned
    tr.st.steps_replayed = 0
    if new_ranks:
        return _restore_tier2(tr, reason=f"rank(s) {new_ranks} lost a shard that tier 1 does not protect (tier1 off)")
    owned.replay_to(target)
    behind = [int(v) for v in set(owned.txn.chunk_ver.tolist()) if v != target]
    assert not behind, f"rank {tr.rank}: chunks at versions {behind} after replay to {target}"
    owned.commit(tr.comm)
    return "local"


def _parity_point(tr: RecoveryInputs, status: list[dict]) -> int | None:
    """The version every survivor's parity holds, if it is one version (else None: a parity
    step was interrupted half-way). A survivor whose snapshot is older (it had absorbed every
    window of that step but not finished its all-gather) catches its snapshot up now."""
    versions = {v for s in status if not s["new"] for v in s["parity_ver"]}
    if len(versions) != 1:
        return None
    p = versions.pop()
    if tr.st.has_state and tr.owned.txn.snap_ver != p:
        tr.owned.take_snapshot(p)  # all our chunks are at p: we staged every one of them
    return p


def _log_source(status: list[dict], first: int, last: int) -> int | None:
    """A survivor whose gradient ring holds steps first..last (-1: nothing is needed)."""
    if first > last:
        return -1
    ok = [s["rank"] for s in status if not s["new"] and s["log_from"] <= first and s["committed"] >= last]
    return min(ok) if ok else None


def _rebuild_sharded(tr: RecoveryInputs, status: list[dict], new_ranks: list[int], target: int, src: int,
                     redo: bool) -> str:
    owned = tr.owned
    tr.st.steps_replayed = 0
    lost_by_group: dict[int, list[int]] = {}
    for r in new_ranks:
        lost_by_group.setdefault(owned.groups.group_of(r), []).append(r)
    can = all(len(v) == 1 for v in lost_by_group.values())
    if target == 0 and not owned.sharded_params:
        # Nothing was ever updated: everyone holds the initial parameters; moments are zero.
        tr.comm.broadcast(owned.flat.params, src=src, what="initial parameter hand-off")
        if tr.rank in new_ranks:
            owned.reset_state()
            owned.txn.chunk_ver[:] = 0
        owned.rebuild_parity(tr.group, 0)
        return "initial"
    point = _parity_point(tr, status)
    oldest = point if point is not None else min(v for s in status if not s["new"] for v in s["parity_ver"])
    c_max = max(s["committed"] for s in status if not s["new"])
    log_src = _log_source(status, oldest + 1, c_max)
    tr.st.steps_replayed = target - oldest if new_ranks else 0  # steps the lost shard is replayed
    # (zero3: a new member's forward gathers its own shard, so it must hold it first: no overlap)
    if point is not None and can and redo and log_src is not None and not owned.sharded_params:
        return _rebuild_overlapped(tr, status, lost_by_group, target, point, log_src)
    mine_lost = lost_by_group.get(owned.groups.group_of(tr.rank), [])
    ok, buf, pv = log_src is not None, None, None
    if can and mine_lost and ok:
        try:
            pv, buf = _decode_input(tr, status, mine_lost[0], rows_at=point)
        except UnrecoverableChunk as e:
            tr.ctx.events.emit("warning", message=f"tier 1 cannot decode rank {mine_lost[0]}: {e}")
            ok = False
    # Everyone must agree before the decode collective: one rank unable means tier 2.
    flag = torch.tensor([0 if (can and ok) else 1], dtype=torch.int32)
    tr.comm.allreduce(flag, what="tier-1 feasibility vote")
    if int(flag) != 0:
        return _restore_tier2(tr, reason="tier 1 cannot decode (two losses in a parity group, a lost version "
                                         "or no survivor holding the gradient log)")
    transfers = _start_log_transfers(tr, status, new_ranks, oldest + 1, c_max, log_src)
    lost = mine_lost[0] if mine_lost else None
    if lost is not None:
        tr.group.xor_reduce(buf, dst=owned.groups.member_of(lost), what=f"tier-1 decode of rank {lost}")
    for p in transfers:
        tr.comm.finish(p)
    if not _install_and_vote(tr, buf, pv, lost, rows_at=point):
        return _restore_tier2(tr, reason="a tier-1 decoded chunk failed its checksum (corrupted parity or data)")
    if tr.rank in new_ranks:
        _adopt_log(tr, status, log_src, point)
    owned.replay_to(target)
    behind = [int(v) for v in set(owned.txn.chunk_ver.tolist()) if v != target]
    assert not behind, f"rank {tr.rank}: chunks at versions {behind} after replay to {target}"
    if point is None:
        owned.rebuild_parity(tr.group, target)
    owned.commit(tr.comm)
    tr.st.parity_rebuilt = "lost rows" if point is not None else "full"
    return "tier1"


def _rebuild_redo_kept(tr: RecoveryInputs, status: list[dict], new_ranks: list[int], target: int) -> str:
    """zero2, a failure inside step target+1's update: every rank redoes the step, keeping the
    chunks that already have it (runtime/zero2_recovery.py). The new member gets the
    parameters of `target` now (for its forward); its chunks, decoded at the versions the
    parity holds (some at target+1), are installed after that forward, in
    `finish_deferred_decode`. Parity is rebuilt in full once the redone step commits."""
    owned = tr.owned
    lost_by_group: dict[int, list[int]] = {}
    for r in new_ranks:
        lost_by_group.setdefault(owned.groups.group_of(r), []).append(r)
    mine_lost = lost_by_group.get(owned.groups.group_of(tr.rank), [])
    sources = region_sources(status, target)
    ok = sources is not None and all(len(v) == 1 for v in lost_by_group.values())
    d = DeferredDecode(target=target, point=None, status=status, log_src=-1, kept=True)
    if ok and mine_lost:
        try:
            d.pv, d.buf = _decode_input(tr, status, mine_lost[0], rows_at=None)
        except UnrecoverableChunk as e:
            tr.ctx.events.emit("warning", message=f"tier 1 cannot decode rank {mine_lost[0]}: {e}")
            ok = False
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    tr.comm.allreduce(flag, what="tier-1 feasibility vote")
    if int(flag) != 0:
        return _restore_tier2(tr, reason="tier 1 cannot decode (two losses in a parity group, or no copy of "
                                         f"the parameters of step {target} left)")
    hand_parameters_at(tr, sources, new_ranks, target)
    if mine_lost:
        d.lost = mine_lost[0]
        d.pending = tr.group.xor_reduce_start(d.buf, dst=owned.groups.member_of(d.lost),
                                              what=f"tier-1 decode of rank {d.lost}")
    owned.rebuild_at = target + 1
    tr.st.deferred = d
    tr.st.parity_rebuilt = "full"
    return "tier1"


_LOG_TAG = 1 << 28  # point-to-point tags far above any collective sequence number of a generation


def _start_log_transfers(tr: RecoveryInputs, status: list[dict], new_ranks: list[int], first: int, last: int,
                         src: int) -> list:
    """The gradient log a new member needs to replay its shard from the parity point:
    steps first..last of its own slice, sent by `src` (one send per step)."""
    owned, pend = tr.owned, []
    if src < 0 or first > last:
        return pend
    for r in new_ranks:
        lo, hi = owned.flat.shard_range(r)
        for step in range(first, last + 1):
            view = owned.flat.grads_of(step)[lo:hi]
            if tr.rank == src:
                pend.append(tr.comm.send_start(view, dst=r, tag=_LOG_TAG + step % _LOG_TAG,
                                               what=f"gradient log step {step} to rank {r}"))
            elif tr.rank == r:
                pend.append(tr.comm.recv_start(view, src=src, tag=_LOG_TAG + step % _LOG_TAG,
                                               what=f"gradient log step {step}"))
    return pend


def _adopt_log(tr: RecoveryInputs, status: list[dict], src: int, point: int | None) -> None:
    """A new member takes the survivors' step log (scalars since the parity point) and, when the
    parity is at one version, their parity interval; its ring holds only what it was sent."""
    owned = tr.owned
    if src >= 0:
        for x in status[src]["history"]:
            owned.txn.history.setdefault(int(x[0]), StepScalars.from_list(x))
    if point is not None:
        owned.txn.snap_ver = point
        owned.next_parity = point + owned.protect_every  # as every survivor's (see _parity_point)
    # our ring holds full averaged gradients only from the step after the last committed one
    owned.log_from = max(s["committed"] for s in status if not s["new"]) + 1


def _rebuild_overlapped(tr: RecoveryInputs, status: list[dict], lost_by_group: dict[int, list[int]], target: int,
                        point: int, log_src: int) -> str:
    """The common case, a failure before the update: nothing changed in step target+1.

    Every survivor's chunks are at `target` and its parity at the parity point `point`, so
    decoding cannot fail for lack of a version, and a survivor that committed `target`
    holds all parameters at it. One broadcast gives every rank those parameters (the new
    member can start its forward at once); the decode (plus the lost member's parity rows)
    and the gradient log the new member needs to replay point+1..target are only *issued*
    here and run on gloo's threads while the new member computes its share of the redone
    step. The new member installs and replays them, and all ranks vote on the checksums, in
    `finish_deferred_decode` just before the step's gradient all-reduce. Until then the new
    member holds no state.
    """
    owned = tr.owned
    src = min(s["rank"] for s in status if not s["new"] and s["committed"] == target)
    tr.comm.broadcast(owned.flat.params, src=src, what="parameter hand-off")
    new_ranks = sorted(r for v in lost_by_group.values() for r in v)
    d = DeferredDecode(target=target, point=point, status=status, log_src=log_src)
    d.transfers = _start_log_transfers(tr, status, new_ranks, point + 1, target, log_src)
    mine_lost = lost_by_group.get(owned.groups.group_of(tr.rank), [])
    if mine_lost:
        d.lost = mine_lost[0]
        d.pv, d.buf = _decode_input(tr, status, d.lost, rows_at=point)
        d.pending = tr.group.xor_reduce_start(d.buf, dst=owned.groups.member_of(d.lost),
                                              what=f"tier-1 decode of rank {d.lost}")
        if tr.rank == d.lost:
            d.expected = owned.flat.params[owned.lo:owned.hi].clone()
    tr.st.deferred = d  # not None: the checksum vote is due (every rank votes, lost member or not)
    tr.st.parity_rebuilt = "lost rows"
    return "tier1"


def _decode_input(tr: RecoveryInputs, status: list[dict], lost: int, *, rows_at: int | None) -> tuple[list, torch.Tensor]:
    """(parity versions of lost's group, this rank's decode buffer): k-1 slots of the lost
    member's chunks, plus slot k-1 for its parity rows (at version `rows_at`) when given. The
    lost member's own buffer stays zero (the reduce's destination). Raises UnrecoverableChunk."""
    owned, k = tr.owned, tr.owned.k
    groups = owned.groups
    pv = [status[r]["parity_ver"] for r in groups.ranks(groups.group_of(tr.rank))]
    rows = rows_at is not None
    buf = torch.zeros((owned.layout.n_windows, k if rows else k - 1, *owned.state.chunk_shape), dtype=torch.int32,
                      device=owned.state.device)
    if tr.rank != lost:
        owned.tier1.decode_contribution(groups.member_of(lost), pv, out=buf[:, :k - 1])
        if rows:
            owned.tier1.row_contribution(groups.member_of(lost), rows_at, buf[:, k - 1])
    return pv, buf


class RolledBack(Exception):
    """A deferred decode failed its checksums: the job went back to a tier-2 checkpoint."""


@dataclass
class DeferredDecode:
    """A decode `_rebuild_overlapped` issued, finished by `finish_deferred_decode`."""

    target: int             # the step every member is at once the new member has replayed
    point: int | None       # the parity point the decode yields (None: each window's own version)
    status: list[dict]      # the recovery's status exchange
    log_src: int            # the survivor sending the gradient log (-1: none needed)
    lost: int | None = None  # the new member of this rank's parity group, if any
    pending: Pending | None = None
    buf: torch.Tensor | None = None
    pv: list | None = None
    transfers: list = field(default_factory=list)
    expected: torch.Tensor | None = None  # the new member's parameter shard at target (broadcast)
    kept: bool = False      # zero2: chunks stay at their decoded versions; the redone step brings the rest


def finish_deferred_decode(tr: RecoveryInputs) -> None:
    """Complete `_rebuild_overlapped`: the new member installs and replays its state; all vote."""
    d, tr.st.deferred = tr.st.deferred, None
    if d.pending is not None:
        tr.group.finish(d.pending)
    for p in d.transfers:
        tr.comm.finish(p)
    ok = _install_and_vote(tr, d.buf, d.pv, d.lost, rows_at=d.point, replay=d)
    if not ok:
        _restore_tier2(tr, reason="a tier-1 decoded chunk failed its checksum or its replay (corrupted parity "
                                  "or data)")
        tr.st.has_state = True
        raise RolledBack(f"restored tier-2 checkpoint of step {tr.st.step_count}")
    tr.st.has_state = True


def _install_and_vote(tr: RecoveryInputs, buf: torch.Tensor | None, pv: list | None, lost: int | None,
                      *, rows_at: int | None, replay: DeferredDecode | None = None) -> bool:
    """The new member `lost` installs what the decode delivered (its chunks, and its parity
    rows when `rows_at` is given), each chunk checked against its CRC (and, on the deferred
    path, replays to the target and checks the parameters against the broadcast ones); then
    every rank votes. True when every install passed (a rank with nothing to install votes yes)."""
    owned, k, bad = tr.owned, tr.owned.k, None
    if lost is not None and tr.rank == lost:
        try:
            owned.tier1.install_decoded(buf[:, :k - 1], pv)
            if rows_at is not None:
                owned.tier1.install_parity(buf[:, k - 1], rows_at)
            if replay is not None and not replay.kept:
                _adopt_log(tr, replay.status, replay.log_src, replay.point)
                owned.replay_to(replay.target)
                if not torch.equal(owned.flat.params[owned.lo:owned.hi], replay.expected):
                    raise CorruptParity(f"rank {lost}'s shard replayed from step {replay.point} to "
                                        f"{replay.target} differs from the survivors' parameters")
        except (CorruptParity, UnrecoverableChunk) as e:
            bad = str(e)
            tr.ctx.events.emit("warning", message=f"rank {lost}: {e}")
    flag = torch.tensor([1 if bad else 0], dtype=torch.int32)
    tr.comm.allreduce(flag, what="tier-1 checksum vote")
    return int(flag) == 0


def resume_from_tier2(tr: RecoveryInputs) -> None:
    """`unbroken run --resume`: every rank of generation 0 loads the newest step whose
    checkpoint is valid for all ranks, as a recovery that lost every rank would."""
    _restore_tier2(tr, reason="resume")


def agree_on_step(comm, newest_own: Callable[[int | None], int | None]) -> int | None:
    """The newest step whose files verify on EVERY rank, each rank checking only its own:
    repeat { m = newest_own(c) (its newest valid step <= c); c' = MIN of m over ranks } until
    c' == c. c never grows and every step valid on all ranks stays <= it, so at the end every
    rank holds c and no newer common step exists. Every rank sees the same c, so all run the
    same rounds (at least two tiny all-reduces); newest_own should cache its checks."""
    bound: int | None = None
    while True:
        mine = newest_own(bound)
        agreed = torch.tensor([-1 if mine is None else mine], dtype=torch.int64)
        comm.allreduce(agreed, op=dist.ReduceOp.MIN, what="tier-2 step agreement")
        if int(agreed) < 0:
            return None
        if int(agreed) == bound:
            return bound
        bound = int(agreed)


def _restore_tier2(tr: RecoveryInputs, *, reason: str) -> str:
    from unbroken.protect.tier2 import load_checkpoint, newest_own_valid_step
    from unbroken.runtime.jobkey import read_job_key

    owned, cfg = tr.owned, tr.cfg
    sharded = owned.sharded
    directory = tr.ctx.run_dir / "checkpoints"
    world, own = (tr.world_size, tr.rank) if sharded else (1, 0)  # a replica: rank 0's files, read by all
    if tr.ckpt is not None:
        tr.ckpt.wait(timeout=cfg.collective_timeout_s)  # our own pending write lands first
    key, run_id, cache = read_job_key(tr.ctx.run_dir), tr.ctx.run_dir.name, {}
    step = agree_on_step(tr.comm, lambda at_most: newest_own_valid_step(
        directory, rank=own, world_size=world, run_id=run_id, key=key, at_most=at_most, cache=cache,
        events=tr.ctx.events))
    if step is None:
        msg = (f"{reason}, and no valid tier-2 checkpoint exists; "
               f"enable checkpoint_every (now {cfg.checkpoint_every}) to survive this")
        # every member agreed on it (the same MIN): one tells the leader, all stop
        crash.declare_fatal(tr.ctx, f"the job's state cannot be restored: {msg}", leader=tr.rank == min(tr.gen.members))
        raise Unrecoverable(msg)
    tr.ctx.events.emit("tier2_restore", step=step, reason=reason)
    tensors, _meta = load_checkpoint(directory, step, rank=own, world_size=world, run_id=run_id, key=key)
    owned.load(tensors, step)
    if owned.tier1 is not None:
        owned.rebuild_parity(tr.group, step)
    owned.commit(tr.comm)
    tr.st.grads_step = None
    tr.st.step_count = step
    return "tier2"
