"""One flat float32 buffer for the trained parameters (and a ring of gradient buffers), sharded by rank.

The trained parameters (those the optimizer updates and that require grad, in the
model's registration order) become views into `params`, so updating a shard of the flat
buffer updates the model. Gradients are copied into `grads` after backward (autograd may
replace a .grad tensor, so we never rely on aliasing it). Past the parameters, one
all-reduce also carries (averaged) a few runtime measurements (`aux`), this rank's
non-finite retry vote (`vote`) and the local loss (`loss`); then (summed, so exact,
because every rank but one writes zeros) each rank's own loss in its slot (`rank_loss`,
the per-step input fingerprint), the squared norm of each rank's reduce-scattered gradient
shard (`norm_sq`, zero2 only) and rank 0's model buffers, encoded (`buffer_words`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

AUX_SLOTS = 4  # ride along in the gradient all-reduce: 3 for runtime/autok.py's measurements, 1 vote


def plan_chunks(n: int, world: int, chunk_elems: int, multiple: int) -> tuple[int, int]:
    """(chunks per rank, elements per chunk) covering n elements over `world` shards.

    The chunk count is a multiple of `multiple` (k-1 for parity windows); elements per
    chunk is rounded up to 16 so that padding stays small.
    """
    per_rank = math.ceil(n / world)
    chunks = max(1, math.ceil(per_rank / chunk_elems))
    chunks = math.ceil(chunks / multiple) * multiple
    elems = math.ceil(math.ceil(per_rank / chunks) / 16) * 16
    return chunks, elems


class FlatModel:
    def __init__(self, named: list[tuple[str, nn.Parameter]], *, world: int, chunk_elems: int, multiple: int,
                 grad_slots: int = 1, ranks: int = 1, buffer_words: int = 0, min_shard: int = 0) -> None:
        self.plist = [p for _, p in named]
        self.names = [name for name, _ in named]
        if not self.plist:
            raise ValueError("the model has no trainable parameters (none requires grad and is in the optimizer)")
        for p in self.plist:
            if p.dtype != torch.float32:
                raise ValueError(f"unbroken trains float32 parameters; got {p.dtype} for a tensor of shape {tuple(p.shape)}")
        devices = sorted({str(p.device) for p in self.plist})
        if len(devices) > 1:
            raise ValueError(f"the trained parameters are on several devices ({', '.join(devices)}): one flat buffer "
                             "holds them all; move the model to one device first")
        self.device = self.plist[0].device  # the buffers live where the model does: nothing moves it
        self.n = sum(p.numel() for p in self.plist)
        # min_shard: a shard layout of its own needs more room per rank (fsdp: FSDP2's padded slots)
        self.chunks_per_rank, self.chunk_elems = plan_chunks(max(self.n, min_shard * world), world, chunk_elems,
                                                             multiple)
        self.shard = self.chunks_per_rank * self.chunk_elems
        self.n_pad = self.shard * world
        self.params = torch.zeros(self.n_pad, device=self.device)
        # A ring of gradient buffers, one per step of the protection interval: the averaged
        # gradient of step s stays in slot s % grad_slots until step s + grad_slots, so a lost
        # shard can be replayed from the last parity point without copying any gradient.
        # layout: [parameters (n_pad) | AUX_SLOTS | local loss || rank losses (ranks) | norm_sq | buffer words]
        # (averaged up to ||, summed after it)
        self.loss = self.n_pad + AUX_SLOTS
        self.n_avg = self.loss + 1
        self.rank_loss = slice(self.n_avg, self.n_avg + ranks)
        self.norm_sq = self.n_avg + ranks
        self.buffers = slice(self.norm_sq + 1, self.norm_sq + 1 + buffer_words)
        self._ring = [torch.zeros(self.buffers.stop, device=self.device) for _ in range(grad_slots)]
        self.aux = slice(self.n_pad, self.n_pad + AUX_SLOTS - 1)
        self.vote = self.n_pad + AUX_SLOTS - 1
        self.grads = self._ring[0]
        self.pad_from = self.n  # collect_grads zeroes [pad_from, n_pad) (fsdp: nothing, its slots are its own)
        off = 0
        with torch.no_grad():
            for p in self.plist:
                k = p.numel()
                self.params[off:off + k].copy_(p.reshape(-1))
                p.data = self.params[off:off + k].view_as(p)
                off += k

    @property
    def grad_slots(self) -> int:
        return len(self._ring)

    def use_grads_of(self, step: int) -> torch.Tensor:
        """Make step's ring slot the current `grads` (where backward and the all-reduce write)."""
        self.grads = self._ring[step % len(self._ring)]
        return self.grads

    def grads_of(self, step: int) -> torch.Tensor:
        """The ring slot that holds (or will hold) step's averaged gradient."""
        return self._ring[step % len(self._ring)]

    def zero_grad(self) -> None:
        for p in self.plist:
            p.grad = None

    def collect_grads(self, loss: float, captured: list[bool] | None = None) -> None:
        """Each parameter's .grad into `grads` (zeros where it has none), except those `captured`
        (zero3 copied them during backward: parallel/units.py); padding zeroed, loss set."""
        off = 0
        for i, p in enumerate(self.plist):
            k = p.numel()
            if captured is not None and captured[i]:
                pass
            elif p.grad is None:
                self.grads[off:off + k].zero_()
            else:
                self.grads[off:off + k].copy_(p.grad.reshape(-1))
                p.grad = None  # the flat buffer holds it now
            off += k
        self.grads[self.pad_from:self.n_pad].zero_()
        self.grads[self.loss] = loss

    def first_nonfinite(self, grads: torch.Tensor) -> str | None:
        """The name of the first parameter whose gradient in `grads` holds NaN/Inf."""
        off = 0
        for name, p in zip(self.names, self.plist):
            k = p.numel()
            if not bool(torch.isfinite(grads[off:off + k]).all()):
                return name
            off += k
        return None

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard
