"""zero2's part of recovery: a step cut short after its gradient reduce-scatter.

Under zero2 each rank holds only its own shard's averaged gradient, so a lost shard's
gradient of the interrupted step t exists nowhere: recovery cannot hand it off and roll
the lost shard forward as zero1 does. Two cases (runtime/recovery.py picks one):
- every survivor finished t's update and every parity window is at t: the lost shard is
  decoded at t and nothing needs a gradient (`update_done`);
- otherwise the step is redone on every rank, on top of the chunks that already have it.
  The new member computes its local gradient of t from the parameters of t-1, which this
  module assembles for it (`hand_parameters_at`): region r comes from rank r's snapshot
  (its shard at t-1) when r survived with one, else from a survivor's copy of region r
  that t's all-gather never touched (a survivor that had not entered it).
"""
from __future__ import annotations

import torch

from unbroken.runtime.state import RecoveryInputs


def update_done(survivors: list[dict], step: int) -> bool:
    """Every survivor's chunks and parity windows are at `step` (its update finished everywhere)."""
    return all(s["chunks"] == [step, step] and set(s["parity_ver"]) == {step} for s in survivors)


def region_sources(status: list[dict], step: int) -> dict[int, tuple[int, str]] | None:
    """For each rank's region of the flat parameters: (the rank that holds it at `step`, "snapshot"
    or "copy"); None when some region has no such holder (then only tier 2 can help)."""
    survivors = [s for s in status if not s["new"]]
    untouched = sorted(s["rank"] for s in survivors if s["gathering"] != step + 1)
    out: dict[int, tuple[int, str]] = {}
    for s in status:
        r = s["rank"]
        if not s["new"] and s["snap_ver"] == step:
            out[r] = (r, "snapshot")
            continue
        others = [x for x in untouched if x != r]
        if not others:
            return None
        out[r] = (others[0], "copy")
    return out


def hand_parameters_at(tr: RecoveryInputs, sources: dict[int, tuple[int, str]], new_ranks: list[int],
                       step: int) -> None:
    """New members receive every region of the parameters at `step` into their flat buffer (one
    broadcast per region; the others receive into a scratch buffer they drop)."""
    owned = tr.owned
    flat = owned.flat
    out = flat.params if tr.rank in new_ranks else torch.empty_like(flat.params)
    for r in range(tr.world_size):
        src, kind = sources[r]
        lo, hi = flat.shard_range(r)
        if tr.rank == src:
            view = owned.snap.tensors[0] if kind == "snapshot" else flat.params[lo:hi]
        else:
            view = out[lo:hi]
        tr.comm.broadcast(view, src=src, what=f"rank {r}'s parameters at step {step}")
