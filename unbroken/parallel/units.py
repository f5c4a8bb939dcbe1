"""zero3's parameters: a rank keeps only its own shard; each unit's parameters exist in full only
while that unit computes (its forward, then its backward), gathered just in time, freed after.

Unit rule: every child of an `nn.ModuleList` of the model (a transformer block), in registration
order, whose trained parameters are its own (a parameter it shares with a module outside it
makes it part of the root instead); a model without a ModuleList has one unit per top-level
child. The trained parameters in no unit (embeddings, a tied output head, final norms) are the
*root* unit: gathered when the model's forward starts, kept until the step's backward has
ended (a tied head reads the embedding last in forward and first in backward), freed then.

The shards are zero2's: rank r owns elements [r*S, (r+1)*S) of the flat parameter order
(`FlatModel`), so the update, its chunks and tier-1 parity are zero2's exactly. A unit's
parameters are views into one buffer of the unit's own size whose storage is resized to zero
bytes while the unit is not needed (the views, and the tensors autograd saved, stay valid:
they point into the same storage). Gathering a unit is one broadcast per piece of it that a
rank owns (a unit spans one or a few shards), issued together on the job's process group and
waited for with the group's timeout: broadcast copies bytes, so every rank computes with the
owner's exact parameters (each at the 64-byte alignment it has in zero2's flat buffer, so
kernels whose arithmetic follows alignment give zero2's bits too). Prefetch: the forward of
unit i issues unit i+1's gather, the backward of unit i (a gradient hook on its outputs)
issues unit i-1's; at most two units and the root are in full at once. A unit is freed after its forward (when autograd will need it
again, a hook on its outputs gathers it once their gradient arrives) and after the last of its
parameters' gradients has been accumulated. During the step's last backward each gradient is
copied into the flat gradient buffer as soon as it is accumulated and the parameter's own
`.grad` dropped (the bytes `FlatModel.collect_grads` would copy, without a second full gradient).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from unbroken.comm.group import Comm, Pending

ALIGN = 16  # elements (64 bytes): a parameter's offset in its unit buffer equals its flat offset modulo this
Piece = tuple[int, int, int, int]  # (buffer start, buffer end, owner rank, offset in the owner's shard)


class _Unit:
    """One unit: its parameters (indices into the flat order), their buffer and what it is doing."""

    def __init__(self, name: str, index: list[int], plist: list[nn.Parameter], offsets: list[int], shard: int) -> None:
        self.name, self.index = name, index
        self.views: list[tuple[int, int]] = []  # per parameter: its slice of buf
        self.pieces: list[Piece] = []
        at = 0
        for i in index:
            k = plist[i].numel()
            at += (offsets[i] - at) % ALIGN  # as aligned as in the flat buffer: the same kernels' bits
            self.views.append((at, at + k))
            self._add_pieces(at, offsets[i], k, shard)
            at += k
        self.numel = at
        self.buf = torch.empty(self.numel, device=plist[index[0]].device)
        self.state = "free"  # free | pending | ready
        self.pending: Pending | None = None
        self.in_backward = False
        self.remaining = 0  # parameter gradients still to come in this backward

    def _add_pieces(self, at: int, off: int, k: int, shard: int) -> None:
        while k > 0:
            owner, rel = divmod(off, shard)
            n = min(k, shard - rel)
            last = self.pieces[-1] if self.pieces else None
            if last and last[1] == at and last[2] == owner and last[3] + (last[1] - last[0]) == rel:
                self.pieces[-1] = (last[0], at + n, owner, last[3])
            else:
                self.pieces.append((at, at + n, owner, rel))
            at, off, k = at + n, off + n, k - n

    def bind(self, plist: list[nn.Parameter]) -> None:
        """The unit's parameters become views of its buffer; the buffer's bytes are freed."""
        with torch.no_grad():
            for i, (a, b) in zip(self.index, self.views):
                plist[i].data = self.buf[a:b].view_as(plist[i])
        self.buf.untyped_storage().resize_(0)


def unit_modules(model: nn.Module, trained: list[nn.Parameter]) -> list[tuple[str, nn.Module]]:
    """The units by the rule of the module docstring: (qualified name, module), in order."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    cands = ([(f"{n}.{c}", sub) for n, m in lists for c, sub in m.named_children()] if lists
             else list(model.named_children()))
    trained_ids = {id(p) for p in trained}
    out = []
    for name, m in cands:
        inside = {id(p) for p in m.parameters()} & trained_ids
        outside = {id(p) for n2, m2 in model.named_modules() if not _within(n2, name)
                   for p in m2.parameters(recurse=False)}
        if inside and not (inside & outside):
            out.append((name, m))
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class UnitParams:
    """Gathers and frees zero3's units around their forward and backward (module docstring)."""

    def __init__(self, model: nn.Module, plist: list[nn.Parameter], shard_of: Callable[[], torch.Tensor], *,
                 rank: int, world: int, shard: int, comm: Callable[[], Comm | None]) -> None:
        self.model, self.plist, self.shard_of, self.rank, self.world = model, plist, shard_of, rank, world
        self.comm = comm
        offsets, off = [], 0
        for p in plist:
            offsets.append(off)
            off += p.numel()
        where = {id(p): i for i, p in enumerate(plist)}
        self.units: list[_Unit] = []
        self._hooks: list = []
        claimed: set[int] = set()
        for name, m in unit_modules(model, plist):
            index = sorted({where[id(p)] for p in m.parameters() if id(p) in where} - claimed)
            if not index:
                continue
            claimed.update(index)
            u = len(self.units)
            self.units.append(_Unit(name, index, plist, offsets, shard))
            self._hooks += [m.register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u)),
                            m.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))]
        rest = [i for i in range(len(plist)) if i not in claimed]
        self.root = _Unit("root", rest, plist, offsets, shard) if rest else None
        self.unit_of: dict[int, _Unit] = {}
        for unit in self.all_units():
            unit.bind(plist)
            for i in unit.index:
                self.unit_of[i] = unit
        self._hooks += [model.register_forward_pre_hook(lambda mod, args: self._root_in()),
                        model.register_forward_hook(lambda mod, args, out: self._root_out())]
        self._hooks += [p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i, p))
                        for i, p in enumerate(plist)]
        self._capture: torch.Tensor | None = None  # the flat gradient buffer of the step's last backward
        self._seen = [False] * len(plist)
        self.offsets = offsets

    def all_units(self) -> list[_Unit]:
        return self.units + ([self.root] if self.root is not None else [])

    @property
    def max_unit_bytes(self) -> int:
        return max(u.numel for u in self.all_units()) * 4

    # --- gather and free -------------------------------------------------------------------
    def _start(self, u: _Unit) -> None:
        if u.state != "free":
            return
        u.buf.untyped_storage().resize_(u.numel * u.buf.element_size())
        shard = self.shard_of()
        with torch.no_grad():
            for a, b, owner, rel in u.pieces:
                if owner == self.rank:
                    u.buf[a:b].copy_(shard[rel:rel + b - a])
        comm = self.comm()
        if self.world > 1 and comm is not None:
            u.pending = comm.broadcast_start([(u.buf[a:b], owner) for a, b, owner, _ in u.pieces],
                                             what=f"zero3 gather of {u.name}")
            u.state = "pending"
        else:
            u.state = "ready"

    def _ensure(self, u: _Unit) -> None:
        self._start(u)
        if u.state == "pending":
            p, u.pending = u.pending, None
            self.comm().finish(p)  # raises CollectiveError (timeout, a lost peer, a newer generation)
            u.state = "ready"

    def _release(self, u: _Unit) -> None:
        if u.state == "pending":
            self._ensure(u)  # never free a buffer a collective still writes into
        if u.state == "ready":
            u.buf.untyped_storage().resize_(0)
        u.state, u.in_backward = "free", False

    # --- hooks -----------------------------------------------------------------------------
    def _root_in(self) -> None:
        if self.root is not None:
            self._ensure(self.root)
        if self.units:
            self._start(self.units[0])  # prefetch the first unit

    def _root_out(self) -> None:
        if not torch.is_grad_enabled() and self.root is not None:
            self._release(self.root)  # an evaluation forward: no backward will read it

    def _before_forward(self, u: int) -> None:
        self._ensure(self.units[u])
        if u + 1 < len(self.units):
            self._start(self.units[u + 1])

    def _after_forward(self, u: int, out) -> None:
        unit = self.units[u]
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outs:
            for t in outs:
                t.register_hook(lambda g, u=u: self._before_backward(u))
        self._release(unit)

    def _before_backward(self, u: int) -> None:
        unit = self.units[u]
        if not unit.in_backward:
            self._ensure(unit)
            unit.in_backward = True
            unit.remaining = sum(1 for i in unit.index if self.plist[i].requires_grad)
            if u > 0:
                self._start(self.units[u - 1])

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if self._capture is not None and not self._seen[i]:
            lo = self.offsets[i]
            self._capture[lo:lo + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None  # the flat buffer holds it now
            self._seen[i] = True
        unit = self.unit_of[i]
        if unit is not self.root and unit.in_backward:
            unit.remaining -= 1
            if unit.remaining == 0:
                self._release(unit)

    # --- the trainer's side ------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step's forward: every unit free (an attempt cut short by a failure may have
        left some gathered; its generation's ops have all ended: `Comm.retire` fences them)."""
        for u in self.all_units():
            u.pending = None
            if u.state != "free":
                u.buf.untyped_storage().resize_(0)
            u.state, u.in_backward = "free", False
        self._capture = None

    def capture(self, grads: torch.Tensor) -> None:
        """The next backward (the step's last) copies each gradient into `grads` as it arrives."""
        self._capture, self._seen = grads, [False] * len(self.plist)

    def end_step(self) -> list[bool]:
        """After the step's backward: free every unit (the root too); returns which parameters'
        gradients were captured (the others got none in the last backward)."""
        for u in self.all_units():
            self._release(u)
        self._capture = None
        return self._seen

    def gather_all(self) -> None:
        """Every unit in full (the final weights file: the model's state dict); `end_step` frees them again."""
        for u in self.all_units():
            self._ensure(u)
        return None

    def close(self) -> None:
        """Remove the hooks; the parameters become plain tensors again (zeros: their values live
        in the shards, and a rebuilt state reads only their shapes)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        with torch.no_grad():
            for p in self.plist:
                p.data = torch.zeros(p.shape, device=p.device)
