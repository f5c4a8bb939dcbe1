"""Replay from the parity point: re-applying logged steps chunk by chunk gives exactly the bytes of
the original steps, and of torch.optim.AdamW stepping the whole model (same groups, same clipping)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.buffers import ModelBuffers
from unbroken.parallel.optim import ChunkOptimizer
from unbroken.parallel.strategy import OwnedState
from unbroken.protect.txn import StepScalars, UnrecoverableChunk
from unbroken.runtime.adopt import trained_parameters


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 8))


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _owned(model, opt, protect_every: int, world: int = 2, rank: int = 1) -> OwnedState:
    named, group_of = trained_parameters(model, opt)
    return OwnedState(named, group_of, ChunkOptimizer(opt), ModelBuffers(model), strategy="zero1", rank=rank,
                      world=world, group_size=2, chunk_elems=48, protect_every=protect_every)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).clone()


@settings(max_examples=15, deadline=None)
@given(steps=st.integers(1, 7), seed=st.integers(0, 10**6), clip=st.sampled_from([1.0, 0.5, 0.01]))
def test_replay_equals_the_steps_and_torch_optim(steps, seed, clip):
    model = _model()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    owned = _owned(model, opt, protect_every=8, world=2, rank=0)  # shard 0: the first half
    tensors = lambda: list(owned.state.tensors)  # noqa: E731  (parameter shard, exp_avg, exp_avg_sq)
    start = [t.clone() for t in tensors()]
    gen = torch.Generator().manual_seed(seed)
    scalars = []
    for t in range(1, steps + 1):
        owned.flat.use_grads_of(t).normal_(generator=gen)
        s = StepScalars(step=t, clip_coef=clip, groups=tuple(ChunkOptimizer(opt).hyper_now()))
        scalars.append(s)
        owned.update(s, None, lambda *_: None, parity=False)
    after = [_bits(t) for t in tensors()]
    # a new member: the state of the parity point (step 0), the log's scalars, the ring's gradients
    for t, s0 in zip(tensors(), start):
        t.copy_(s0)
    owned.txn.chunk_ver[:] = 0
    assert owned.replay_to(steps) == steps * owned.state.n_chunks
    assert all(torch.equal(_bits(t), a) for t, a in zip(tensors(), after))
    # reference: torch.optim.AdamW on the whole model, gradients scaled as clip_grad_norm_ scales them
    ref = _model()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    for s in scalars:
        off = 0
        for p in ref.parameters():
            g = owned.flat.grads_of(s.step)[off:off + p.numel()].view(p.shape)
            p.grad = g * clip if clip != 1.0 else g.clone()
            off += p.numel()
        ref_opt.step()
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])[:owned.hi]
    assert torch.equal(_bits(flat_ref), after[0][:flat_ref.numel()])


def test_replay_needs_the_logged_scalars():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    owned = _owned(model, opt, protect_every=4)
    owned.flat.use_grads_of(1).fill_(0.1)
    owned.update(StepScalars(step=1, groups=tuple(ChunkOptimizer(opt).hyper_now())), None, lambda *_: None,
                 parity=False)
    owned.take_snapshot(1)
    owned.txn.chunk_ver[:] = 0  # pretend the chunks were decoded at step 0: step 1's scalars are gone
    with pytest.raises(UnrecoverableChunk, match="no scalars recorded for step 1"):
        owned.replay_to(1)
