"""One generation of the training pool: a gloo group over a store prefix per generation, the state
sync that brings the processes that just joined up to date (rank 0 of the generation, always a
process that holds the current state, sends them the weights and the optimizer state; the others
hold them already), and the data-parallel update: every rank's gradient of its share of the
step, summed by all-reduce, one identical step.
A rollout worker idle while the step trains may compute a share too (a *helper*): it puts its
flat gradient in the store under `help_key`, and rank 0 adds it to its own before the all-reduce,
helpers in a fixed order; a share whose helper was lost (the coordinator marks its key LOST) or
did not answer in time rank 0 computes itself."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from unbroken.rl import grpo, statewire
from unbroken.rl.config import RLConfig

TIMEOUT_S = 60.0
HELP_TIMEOUT_S = 30.0  # rank 0's wait for a helper's gradient before it computes the share itself
HELP_POLL_S = (0.0005, 0.005)  # rank 0 looks for a helper's gradient every 0.5 ms at first, doubling to 5 ms
LOST = b"lost"


def help_key(run: str, gen: int, step: int, k: int) -> str:
    """Where helper k of step `step`, training generation `gen`, leaves its gradient."""
    return f"rl/{run}/help/{gen}/{step}/{k}"


def share_gradient(model, samples: list[grpo.Sample], cfg: RLConfig, normalizer: float, ref=None) -> torch.Tensor:
    """The flat gradient of one share of a step's samples (zeros for an empty share); grads reset first."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    if samples:
        grpo.loss(model, samples, cfg, normalizer, ref).backward()
    return _flat(params)


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def helper_gradient(store: dist.Store, key: str, like: torch.Tensor, compute) -> torch.Tensor:
    """A helper's gradient from the store; `compute()` when it was lost or is late (HELP_TIMEOUT_S).
    Polled with `check`, not a `wait` that times out: a timed-out wait leaves the store client
    expecting an answer that comes later. The pause between looks doubles (HELP_POLL_S): a share that
    is nearly done is picked up at once, and a slow one does not cost a store round trip every 0.5 ms.
    What a late helper writes the coordinator removes."""
    deadline, pause = time.monotonic() + HELP_TIMEOUT_S, HELP_POLL_S[0]
    while not store.check([key]):
        if time.monotonic() > deadline:
            return compute()
        time.sleep(pause)
        pause = min(2 * pause, HELP_POLL_S[1])
    data = store.get(key)
    store.delete_key(key)
    if data == LOST:
        return compute()
    return torch.frombuffer(bytearray(data), dtype=like.dtype)


class GroupError(RuntimeError):
    """A collective of the training group failed or timed out (a rank died): the step was not applied."""


def _wait(work, what: str) -> None:
    try:
        work.wait(timedelta(seconds=TIMEOUT_S))
    except RuntimeError as e:
        raise GroupError(f"{what} failed in the training group: {e}") from None


class TrainGroup:
    """Rank `rank` of `world` in generation `gen` of run `run` (group prefix rl/RUN/train/GEN/)."""

    def __init__(self, store: dist.Store, run: str, gen: int, rank: int, world: int) -> None:
        self.gen, self.rank, self.world = gen, rank, world
        prefixed = dist.PrefixStore(f"rl/{run}/train/{gen}/", store)
        try:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=TIMEOUT_S))
        except RuntimeError as e:
            raise GroupError(f"forming training generation {gen} (rank {rank} of {world}) failed: {e}") from None

    def sync_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, joiners: tuple[int, ...] = ()) -> None:
        """The ranks in `joiners` leave with rank 0's weights and optimizer state, sent to each (sizes,
        then a statewire layout and flat tensor); the other ranks applied the same steps as rank 0
        and hold them already."""
        if not joiners:
            return
        if 0 in joiners:
            raise ValueError("rank 0 of a training generation must hold the state it hands to the joiners")
        if self.rank == 0:
            layout, flat = statewire.pack(model, opt)
            parts = (torch.tensor([len(layout), flat.numel()], dtype=torch.long),
                     torch.frombuffer(bytearray(layout), dtype=torch.uint8), flat)
            sends = [self.pg.send([t], j, tag) for j in joiners for tag, t in enumerate(parts)]
            for work in sends:
                _wait(work, "sending the state to a joining rank")
        elif self.rank in joiners:
            sizes = torch.empty(2, dtype=torch.long)
            _wait(self.pg.recv([sizes], 0, 0), "receiving the state's sizes")
            layout, flat = (torch.empty(int(n), dtype=torch.uint8) for n in sizes)
            _wait(self.pg.recv([layout], 0, 1), "receiving the state's layout")
            _wait(self.pg.recv([flat], 0, 2), "receiving the state")
            statewire.unpack_into(model, opt, layout.numpy().tobytes(), flat)

    def update(self, model, opt, samples: list[grpo.Sample], cfg: RLConfig, normalizer: float, ref=None,
               helped: tuple = (), store: dist.Store | None = None) -> float:
        """One optimizer step on the whole step's samples, of which this rank holds `samples` and, on
        rank 0, `helped`: [(store key, share)] computed by helpers, added in this order."""
        opt.zero_grad(set_to_none=True)
        params = [p for p in model.parameters()]
        if samples:
            loss = grpo.loss(model, samples, cfg, normalizer, ref)
            loss.backward()
            value = float(loss.detach())
        else:  # more ranks than samples: contribute a zero gradient
            value = 0.0
        flat = _flat(params)
        for key, share in helped:
            flat += helper_gradient(store, key, flat, lambda share=share: share_gradient(model, share, cfg, normalizer, ref))
        if self.world > 1:
            _wait(self.pg.allreduce([flat]), "the gradient all-reduce")
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, grpo.GRAD_CLIP)
        opt.step()
        return value
