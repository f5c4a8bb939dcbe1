"""zero3's (and fsdp's) part of the Trainer, and zero2's gradient reduce-scatter: the unit gathers
around each step and the collective reads of the full parameters at the end (their hash, the final
weights file), none of which may hold a full copy of the parameters while training. fsdp's own are
in runtime/fsdp.py."""
from __future__ import annotations

import hashlib
import math

import torch

from unbroken.comm.group import Comm
from unbroken.parallel.strategy import OwnedState
from unbroken.parallel.units import UnitParams


def build_units(model, owned: OwnedState, comm):
    """zero3: the model's units bound to this rank's shard; fsdp: its FSDP2 wrapping (None for
    the other strategies)."""
    if not owned.sharded_params:
        return None
    if owned.fsdp is not None:
        from unbroken.runtime.fsdp import FsdpUnits  # torch's FSDP2 only where it is used

        return FsdpUnits(model, owned, comm)
    return UnitParams(model, owned.flat.plist, lambda: owned.param_shard, rank=owned.rank, world=owned.world,
                      shard=owned.flat.shard, comm=comm)


def sharded_sha256(comm: Comm, owned: OwnedState) -> str:
    """sha256 of the flat parameters [0, n) (what the other strategies hash), streamed shard by
    shard: each owner broadcasts its shard into one shard-sized buffer. Collective."""
    if owned.fsdp is not None:
        from unbroken.runtime.fsdp import sha256

        return sha256(comm, owned)
    flat, h = owned.flat, hashlib.sha256()
    buf = torch.empty_like(owned.param_shard)
    for r in range(owned.world):
        if r == owned.rank:
            buf.copy_(owned.param_shard)
        if owned.world > 1:
            comm.broadcast(buf, src=r, what=f"final weights hash: rank {r}'s shard")
        lo = r * flat.shard
        take = max(0, min(flat.shard, flat.n - lo))
        if take:
            h.update(buf[:take].cpu().numpy().tobytes())
    return h.hexdigest()


# --- the local gradient a redo reuses ---------------------------------------------------------
# A survivor redoing a step reuses its local gradient instead of computing it again, so only the
# replacement computes. Not under zero3: the replacement's forward gathers every unit from every
# rank, so every rank runs the forward (and backward) again, and zero3 keeps no copy.

def kept_buffer(owned: OwnedState) -> torch.Tensor:
    if owned.sharded_params:
        return torch.empty(0, device=owned.flat.device)
    return torch.empty_like(owned.flat.grads)


def keep_local(owned: OwnedState, grads: torch.Tensor, kept: torch.Tensor, step: int) -> int | None:
    """Keep the local gradient for a redo; returns the step kept (None: nothing is, zero3)."""
    if owned.sharded_params:
        return None
    kept.copy_(grads)
    return step


def shard_grad_buffer(owned: OwnedState) -> torch.Tensor | None:
    """zero2's reduce-scatter output (ddp and zero1 all-reduce in place, fsdp's FSDP2 reduce-scatters
    into its own buffers: nothing to allocate)."""
    if not owned.sharded_grads or owned.fsdp is not None:
        return None
    return torch.empty(owned.hi - owned.lo, device=owned.flat.device)


def sum_gradient_shard(comm: Comm, owned: OwnedState, grads: torch.Tensor, out: torch.Tensor, *,
                       what: str) -> torch.Tensor:
    """This rank's shard of the local gradients summed over the ranks (zero2's reduce-scatter).
    zero3 on gloo all-reduces the ring slot in place instead: gloo's reduce-scatter *is* an
    all-reduce of a copy of its input, sliced (ProcessGroupGloo::reduce_scatter_tensor_coalesced),
    so the bits are zero2's without that model-sized copy; zero3 keeps no local gradient for a
    redo, so nothing needs the slot's other regions. Returns `out` or the slot's shard view."""
    flat = owned.flat
    if owned.fsdp is not None:  # FSDP2's reduce-scatter summed it into the slot during backward
        return grads[owned.lo:owned.hi]
    if owned.sharded_params and owned.world > 1 and comm.on_gloo(grads):
        comm.allreduce(grads[:flat.n_pad], what=what.replace("reduce-scatter", "all-reduce (as gloo's reduce-scatter)"))
        return grads[owned.lo:owned.hi]
    comm.reduce_scatter(out, grads[:flat.n_pad], what=what)
    return out


def reduce_scatter_gradient(comm: Comm, owned: OwnedState, grads: torch.Tensor, out: torch.Tensor, t: int) -> float:
    """zero2/zero3: sum the local gradients over the ranks into this rank's shard only (the rest of
    `grads` keeps this rank's local gradient), average it, then one small all-reduce of the
    tail (loss, votes, fingerprints, buffers) that also sums each shard's squared norm.
    Returns the averaged gradient's global norm."""
    flat, world = owned.flat, owned.world
    shard = sum_gradient_shard(comm, owned, grads, out, what=f"gradient reduce-scatter step {t}")
    shard.div_(world)
    grads[owned.lo:owned.hi].copy_(shard)
    grads[flat.norm_sq] = float(torch.linalg.vector_norm(shard)) ** 2
    comm.allreduce(grads[flat.n_pad:], what=f"gradient tail all-reduce step {t}")
    grads[flat.n_pad:flat.n_avg].div_(world)
    return math.sqrt(float(grads[flat.norm_sq]))
