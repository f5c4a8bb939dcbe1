"""The eager (per-bucket) update: chunks updated as their buckets land give the bytes of the update
applied after the last bucket; a wrong guess (a clipped or skipped step) or a step cut short
leaves every chunk, its version and the step log exactly as before the step."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.buckets import GradBuckets
from unbroken.parallel.buffers import ModelBuffers
from unbroken.parallel.eager import EagerUpdate
from unbroken.parallel.optim import ChunkOptimizer
from unbroken.parallel.strategy import OwnedState
from unbroken.protect.txn import StepScalars
from unbroken.runtime.adopt import trained_parameters

WORLD = 2


def _owned(strategy: str, rank: int) -> OwnedState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 8))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=1e-2)
    named, group_of = trained_parameters(model, opt)
    owned = OwnedState(named, group_of, ChunkOptimizer(opt), ModelBuffers(model), strategy=strategy, rank=rank,
                       world=WORLD, group_size=2, chunk_elems=48, protect_every=8)
    owned.param_shard.copy_(torch.randn(owned.param_shard.numel()))
    return owned


def _bits(owned: OwnedState) -> list[torch.Tensor]:
    return [t.view(torch.int32).clone() for t in owned.state.tensors]


def _summed_gradient(owned: OwnedState, seed: int, scale: float, nan: bool) -> None:
    """What the all-reduce leaves in flat.grads: the ranks' sum (here WORLD x one gradient)."""
    g = torch.Generator().manual_seed(seed)
    grads = owned.flat.grads
    grads.copy_(torch.randn(grads.numel(), generator=g) * scale * WORLD)
    if nan:
        grads[owned.flat.n // 2] = float("nan")


def _scalars(owned: OwnedState, t: int, clip: float | None) -> StepScalars:
    flat = owned.flat
    norm = float(torch.linalg.vector_norm(flat.grads[:flat.n_pad]))
    groups = tuple(owned.optim.hyper_now())
    if norm != norm:
        return StepScalars(step=t, clip_coef=0.0, skip=True, groups=groups)
    coef = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
    return StepScalars(step=t, clip_coef=coef, groups=groups)


def _no_point(phase, c):
    return None


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), scales=st.lists(st.sampled_from([0.01, 0.01, 5.0]), min_size=3, max_size=6),
       nan_at=st.integers(0, 8), bucket=st.sampled_from([40, 200, 10**6]), strategy=st.sampled_from(["ddp", "zero1"]))
def test_eager_update_gives_the_bytes_of_the_update_after_the_last_bucket(seed, scales, nan_at, bucket, strategy):
    rank = 1 if strategy == "zero1" else 0
    ref, eager_owned = _owned(strategy, rank), _owned(strategy, rank)
    buckets = GradBuckets(eager_owned.flat, bucket, first_elems=max(16, bucket // 4))
    eager = EagerUpdate(eager_owned, buckets, WORLD)
    kept_any = False
    for t, scale in enumerate(scales, start=1):
        for owned in (ref, eager_owned):
            _summed_gradient(owned, seed + t, scale, nan=t == nan_at)
        # the reference: average everything, then the update (clipping at 1.0: large steps are clipped)
        ref.flat.grads[:ref.flat.n_avg].div_(WORLD)
        s = _scalars(ref, t, clip=1.0)
        ref.update(s, None, _no_point, parity=False)
        eager.arm(t, s.groups, enabled=True, point=_no_point)
        for b in range(buckets.n_buckets):
            eager.landed(b)
        eager.average(eager_owned.flat.grads)
        real = _scalars(eager_owned, t, clip=1.0)
        assert real == s
        kept_any |= eager.settle(real) > 0
        eager_owned.update(real, None, _no_point, parity=False)
        assert all(torch.equal(a, b) for a, b in zip(_bits(ref), _bits(eager_owned))), f"step {t} differs"
        assert (eager_owned.txn.chunk_ver == t).all()
    buckets.close()
    if scales[0] == 0.01 and nan_at != 1:
        assert kept_any  # an unclipped first step is applied eagerly


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_step_cut_short_leaves_chunks_versions_and_log_as_before(strategy):
    owned = _owned(strategy, 1 if strategy == "zero1" else 0)  # zero1: the last shard, whose buckets land first
    buckets = GradBuckets(owned.flat, 40, first_elems=16)
    eager = EagerUpdate(owned, buckets, WORLD)
    assert buckets.n_buckets > 2
    before, log = _bits(owned), dict(owned.txn.history)
    _summed_gradient(owned, 3, 0.01, nan=False)
    eager.arm(1, tuple(owned.optim.hyper_now()), enabled=True, point=_no_point)
    for b in range(buckets.n_buckets - 1):  # the last bucket's all-reduce fails
        eager.landed(b)
    assert eager.applied and (owned.txn.chunk_ver == 1).any()
    assert not all(torch.equal(a, b) for a, b in zip(before, _bits(owned)))
    assert eager.settle(None) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _bits(owned)))
    assert (owned.txn.chunk_ver == 0).all() and owned.txn.history == log
    # a redo whose earlier attempt had logged the step's scalars: the undo puts that entry back
    logged = StepScalars(step=1, clip_coef=0.25, groups=tuple(owned.optim.hyper_now()))
    owned.txn.record(logged)
    eager.arm(1, logged.groups, enabled=True, point=_no_point)
    eager.landed(0)
    eager.settle(None)
    assert owned.txn.history[1] == logged and (owned.txn.chunk_ver == 0).all()
    buckets.close()


def test_no_guess_on_a_parity_step_nor_after_a_clipped_step():
    owned = _owned("zero1", 0)
    buckets = GradBuckets(owned.flat, 40)
    eager = EagerUpdate(owned, buckets, WORLD)
    groups = tuple(owned.optim.hyper_now())
    eager.arm(8, groups, enabled=True)  # chunks are at version 0, not 7
    assert eager.guess is None and not eager.divided
    owned.txn.chunk_ver[:] = 7
    owned.next_parity = 8
    eager.arm(8, groups, enabled=True)  # a parity step: its update sends deltas
    assert eager.guess is None
    owned.next_parity = 16
    eager.arm(8, groups, enabled=False)  # the plan turned it off
    assert eager.guess is None
    eager.arm(8, groups, enabled=True)
    assert eager.guess is not None
    eager.settle(StepScalars(step=8, clip_coef=0.5, groups=groups))  # clipped: undone, and no guess next step
    owned.txn.chunk_ver[:] = 8
    eager.arm(9, groups, enabled=True)
    assert eager.guess is None
    buckets.close()


def test_the_first_bucket_is_the_small_one_and_the_buckets_tile_the_gradient():
    owned = _owned("ddp", 0)
    flat = owned.flat
    buckets = GradBuckets(flat, 200, first_elems=16)
    sizes = [hi - lo for lo, hi in buckets.ranges]
    assert buckets.ranges[0][1] == flat.grads.numel() and buckets.ranges[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(buckets.ranges, buckets.ranges[1:]))  # contiguous, top down
    same = GradBuckets(flat, 200)
    assert sizes[0] < same.ranges[0][1] - same.ranges[0][0]  # issued sooner than a full-size first bucket
    assert sizes[0] < 200 <= min(sizes[1:-1], default=200)
    buckets.close()
    same.close()
