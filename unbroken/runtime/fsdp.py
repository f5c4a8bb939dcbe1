"""`--strategy fsdp`: PyTorch's FSDP2 `fully_shard` computes each step; unbroken owns its state.

The model is wrapped once per process with `fully_shard` (each unit by zero3's rule, then the
root; `reshard_after_forward=True`) on a one-dimensional DeviceMesh of the job's ranks. FSDP2
all-gathers each unit's parameters for its forward and backward and reduce-scatters the
gradients, but through its public custom-collective hooks (`set_custom_all_gather`,
`set_custom_reduce_scatter`) both go over the *current* generation's `Comm`: unbroken's timeouts,
generation interrupts and CollectiveError apply to them, and after a recovery the same wrapping
runs on the new generation's group (ranks keep their numbers: a shadow takes the dead rank's).
The mesh's own process group carries no traffic; it only tells FSDP2 the rank and world size.

The state a rank owns is `OwnedState.param_shard` (FSDP2's padded local slots, laid out by
parallel/fsdp_layout.py) and its optimizer state, protected as zero3's (tier-1 parity every step,
chunk transactions, tier 2). FSDP2's sharded parameters are a copy: before every forward they
are refreshed from the committed shard, so a step cut short, rolled back, decoded or replayed is
what FSDP2 computes with next, and no half-applied update is ever visible to it. After backward
each local gradient (summed over the ranks by the reduce-scatter; the runtime divides, as for
zero2) is copied into the rank's region of the gradient ring. After an attempt fails, FSDP2's
own `reset_iter_state()` clears its per-iteration state before the next forward.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from unbroken.comm.group import Comm
from unbroken.parallel.strategy import OwnedState
from unbroken.parallel.units import unit_modules

_names = itertools.count()


def _mesh(rank: int, world: int, device_type: str) -> DeviceMesh:
    """A 1-D mesh over a process group with no backend: FSDP2 reads rank and size from it; every
    byte goes through the custom collectives below (on CUDA: not yet run on a GPU)."""
    from torch.distributed import distributed_c10d as c10d

    name = f"unbroken-fsdp-mesh-{next(_names)}"
    pg = dist.ProcessGroup(dist.HashStore(), rank, world)
    pg._set_group_name(name)
    c10d._register_process_group(name, pg)
    mesh = DeviceMesh(device_type, torch.arange(world, dtype=torch.int), _init_backend=False, _rank=rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = pg
    return mesh


class _OnComm:
    """An FSDP2 custom collective that runs over the current generation's Comm (plain buffers)."""

    def __init__(self, comm: Callable[[], Comm | None]) -> None:
        self.comm = comm

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _Gather(_OnComm, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.comm().allgather_into(output_tensor, input_tensor, what="FSDP2 parameter all-gather")
        return None


class _ReduceScatter(_OnComm, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        assert op in (dist.ReduceOp.SUM, dist.ReduceOp.SUM.value), f"FSDP2 asked for {op}, unbroken sums"
        self.comm().reduce_scatter(output_tensor, input_tensor, what="FSDP2 gradient reduce-scatter")
        return None


class FsdpUnits:
    """The FSDP2 wrapping of the model around each step (the zero3 `UnitParams` interface)."""

    def __init__(self, model: nn.Module, owned: OwnedState, comm: Callable[[], Comm | None]) -> None:
        self.model, self.owned, self.comm = model, owned, comm
        self.plist, self.layout = owned.flat.plist, owned.fsdp
        ids = {id(p): i for i, p in enumerate(self.plist)}
        self._where: list[tuple[nn.Module, str] | None] = [None] * len(self.plist)
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in ids and self._where[ids[id(p)]] is None:
                    self._where[ids[id(p)]] = (m, name)
        self._capture: torch.Tensor | None = None
        self._dirty = False  # an attempt began and did not end: FSDP2's iteration state needs a reset
        if isinstance(model, FSDPModule):  # a rebuilt state (a shadow's, once it has its rank)
            wrapped = getattr(model, "_unbroken_fsdp_rank", None)
            if wrapped != (owned.rank, owned.world):
                raise RuntimeError(f"the model is wrapped for rank/world {wrapped}, this state is rank "
                                   f"{owned.rank} of {owned.world}: FSDP2 cannot re-shard a wrapped model")
            self._release()

    def _wrap(self) -> None:
        """fully_shard each unit, then the root (once per process, at the first forward: a shadow
        learns its rank first). The old parameters' storage (the full flat buffer) is let go."""
        model, owned = self.model, self.owned
        if isinstance(model, FSDPModule):
            return
        mesh = _mesh(owned.rank, owned.world, owned.flat.device.type)
        mods = [m for _, m in unit_modules(model, self.plist)] + [model]
        for m in mods:
            fully_shard(m, mesh=mesh, reshard_after_forward=True)
        for m in mods:
            m.set_custom_all_gather(_Gather(self.comm))
            m.set_custom_reduce_scatter(_ReduceScatter(self.comm))
            m.set_gradient_divide_factor(1.0)  # sum: the runtime averages, as for zero2/zero3
            m.set_force_sum_reduction_for_comms(True)
        model._unbroken_fsdp_rank = (owned.rank, owned.world)
        self._release()

    def _release(self) -> None:
        """The adopted parameters (no longer the model's) keep their shapes only: a rebuilt
        FlatModel reads them, and their storage (the full flat buffer) is freed."""
        with torch.no_grad():
            for p in self.plist:
                p.data = torch.zeros((), device=p.device).expand(p.shape)

    def _param(self, i: int) -> torch.Tensor:
        m, name = self._where[i]
        return getattr(m, name)

    # --- the trainer's side ------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step's forward: FSDP2's sharded parameters from the committed shard."""
        self._wrap()
        if self._dirty:
            self.model.reset_iter_state()  # the last attempt failed mid-flight
        self._dirty = True
        for m in self.model.modules():
            for p in m._parameters.values():
                if p is not None:
                    p.grad = None
        self._load_shard()
        self._capture = None

    def _load_shard(self) -> None:
        """FSDP2's local shards := the committed owned shard (the commit of the last update)."""
        shard = self.owned.param_shard
        with torch.no_grad():
            for i, s in enumerate(self.layout.slots):
                local = self._param(i).to_local()
                if local.numel():
                    local.view(-1).copy_(shard[s.offset:s.offset + local.numel()])

    def capture(self, grads: torch.Tensor) -> None:
        """The step's last backward: its local gradient goes into this rank's region of `grads`."""
        self._capture = grads

    def end_step(self) -> list[bool]:
        """After backward: each parameter's reduce-scattered gradient into the captured region
        (its slot's padding zero); returns that every parameter's gradient was captured."""
        if self._capture is not None:
            region = self._capture[self.owned.lo:self.owned.hi]
            region.zero_()
            for i, s in enumerate(self.layout.slots):
                q = self._param(i)
                if q.grad is not None:
                    g = q.grad.to_local()
                    region[s.offset:s.offset + g.numel()].copy_(g.reshape(-1))
                    q.grad = None
        self._capture, self._dirty = None, False
        return [True] * len(self.plist)

    def gather_all(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every sharded tensor in full (collective: every rank calls it),
        after the last update (FSDP2's copy is otherwise refreshed only before a forward)."""
        self._wrap()
        self._load_shard()
        out = {}
        for name, t in self.model.state_dict().items():
            out[name] = self._full(t) if hasattr(t, "to_local") else t
        return out

    def _full(self, t) -> torch.Tensor:
        """A dim-0-sharded DTensor in full: each rank's padded slot all-gathered over Comm."""
        world, local = self.owned.world, t.to_local()
        rows = -(-t.shape[0] // world)
        row = t.numel() // max(1, t.shape[0])
        mine = torch.zeros(rows * row, dtype=local.dtype, device=local.device)
        mine[:local.numel()].copy_(local.reshape(-1))
        out = torch.empty(world * rows * row, dtype=local.dtype, device=local.device)
        self.comm().allgather_into(out, mine, what="final weights: FSDP2 shard all-gather")
        return out[:t.numel()].view(t.shape)

    def close(self) -> None:
        """Nothing to undo: the wrapping outlives a rebuilt state (its collectives follow `comm`)."""
        self._capture = None


def sha256(comm: Comm, owned: OwnedState) -> str:
    """sha256 of the trained parameters in flat order (what the other strategies hash), each
    all-gathered from its slots of the owned shards in turn. Collective."""
    h, lay = hashlib.sha256(), owned.fsdp
    for i, s in enumerate(lay.slots):
        out = torch.empty(owned.world * s.size, device=owned.param_shard.device)
        comm.allgather_into(out, owned.param_shard[s.offset:s.offset + s.size],
                            what=f"final weights hash: parameter {i}")
        h.update(lay.full_from_slots(out, i).cpu().numpy().tobytes())
    return h.hexdigest()
