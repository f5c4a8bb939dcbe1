"""Replay from the parity point: re-applying logged steps chunk by chunk gives exactly the bytes of
the original steps, and of a naive reference that applies AdamW to whole tensors step by step."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.adamw import AdamW
from unbroken.parallel.strategy import OwnedState
from unbroken.protect.txn import StepScalars


def _owned(protect_every: int) -> OwnedState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 8))
    return OwnedState(model, strategy="zero1", rank=1, world=2, group_size=2, chunk_elems=48,
                      optim=AdamW(lr=1e-2, warmup_steps=2, total_steps=20), protect_every=protect_every)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).clone()


@settings(max_examples=15, deadline=None)
@given(steps=st.integers(1, 7), seed=st.integers(0, 10**6), clip=st.sampled_from([1.0, 0.5, 0.01]))
def test_replay_equals_the_steps_and_a_naive_reference(steps, seed, clip):
    owned = _owned(protect_every=8)
    lo, hi = owned.lo, owned.hi
    start = [t.clone() for t in (owned.flat.params[lo:hi], owned.m, owned.v)]
    gen = torch.Generator().manual_seed(seed)
    scalars = []
    for t in range(1, steps + 1):
        owned.flat.use_grads_of(t).normal_(generator=gen)
        s = owned.optim.scalars(t, 1.0 / clip)  # grad norm 1/clip -> clip coefficient ~clip
        scalars.append(s)
        owned.update(s, None, lambda *_: None, parity=False)
    after = [_bits(t) for t in (owned.flat.params[lo:hi], owned.m, owned.v)]
    # a new member: the state of the parity point (step 0), the log's scalars, the ring's gradients
    for t, s0 in zip((owned.flat.params[lo:hi], owned.m, owned.v), start):
        t.copy_(s0)
    owned.txn.chunk_ver[:] = 0
    assert owned.replay_to(steps) == steps * owned.state.n_chunks
    assert all(torch.equal(_bits(t), a) for t, a in zip((owned.flat.params[lo:hi], owned.m, owned.v), after))
    # naive reference: whole tensors, one step after another
    p, m, v = (s0.clone() for s0 in start)
    for s in scalars:
        owned.optim.apply(p, owned.flat.grads_of(s.step)[lo:hi], m, v, s)
    assert all(torch.equal(_bits(x), a) for x, a in zip((p, m, v), after))


def test_replay_needs_the_logged_scalars():
    owned = _owned(protect_every=4)
    owned.flat.use_grads_of(1).fill_(0.1)
    owned.update(StepScalars(step=1, lr=1e-2, clip_coef=1.0), None, lambda *_: None, parity=False)
    owned.take_snapshot(1)
    owned.txn.chunk_ver[:] = 0  # pretend the chunks were decoded at step 0: step 1's scalars are gone
    import pytest

    from unbroken.protect.txn import UnrecoverableChunk
    with pytest.raises(UnrecoverableChunk, match="no scalars recorded for step 1"):
        owned.replay_to(1)
