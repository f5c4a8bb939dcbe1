"""Our all-reduce per gradient bucket during backward (comm/bucketed.py) on real gloo groups (threads)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.unit.commgroups import groups, on_ranks
from unbroken.comm.adaptive import AdaptiveAllreduce
from unbroken.comm.bucketed import BucketedAllreduce
from unbroken.comm.group import CollectiveError
from unbroken.comm.patterns import reference
from unbroken.parallel.buckets import GradBuckets
from unbroken.parallel.flat import FlatModel

SLOW, FAST = 125e6 / 4, 125e6


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 7))


@pytest.mark.parametrize("world", [3, 4])
def test_buckets_reduced_during_backward_equal_the_reference_and_plans_agree(world):
    """Several buckets per step, issued from the gradient hooks while backward runs; a plan change
    between steps; a flow exchange after buckets over learn_bytes (set small): every step's reduced
    gradient equals the naive reduction of the local gradients bit for bit, on every rank."""

    def body(tp, r):
        model = _model(0)  # the same weights everywhere, different data per rank
        flat = FlatModel(list(model.named_parameters()), world=world, chunk_elems=64, multiple=1, grad_slots=2)
        buckets = GradBuckets(flat, bucket_elems=200)
        assert buckets.n_buckets >= 3
        ours = BucketedAllreduce(AdaptiveAllreduce(groups(world)[r], rank=r, world=world, timeout_s=20,
                                                   learn_bytes=4 << 10))
        local = torch.zeros_like(flat.grads)
        got, want, plans = [], [], []
        try:
            for step in range(3):
                if step == 2:  # as if rank 1's links had been measured slow: the next plans go around it
                    for _ in range(6):
                        for rr in range(world):
                            for way in ("up", "down"):
                                ours.ours.table.observe((way, rr), SLOW if rr == 1 else FAST)
                    ours.ours.decide(64 << 20)
                grads = flat.use_grads_of(step)
                flat.zero_grad()
                g = torch.Generator().manual_seed(100 * step + r)
                loss = model(torch.randn(16, 24, generator=g)).square().mean()
                buckets.begin(ours, grads, local, float(loss.detach()), poison=False, what=f"step {step}")
                loss.backward()
                buckets.finish()
                whole = local.clone()  # each bucket's local gradient, kept as issued
                reference(tp, whole, seq=900 + step)
                got.append(grads.clone())
                want.append(whole)
                plans.append([h["plan"] for h in ours.ours.history])
            exchanged = sum(h["sync_s"] is not None for h in ours.ours.history)
        finally:
            buckets.close()
            ours.close()
        return got, want, plans, exchanged

    runs = on_ranks(world, body, timeout_s=60)
    for got, want, plans, exchanged in runs:
        assert exchanged >= 2  # flows were exchanged and folded in between buckets
        assert plans == runs[0][2]  # the same plan at the same collective on every rank
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert any(p["split"][1] == 0 for p in runs[0][2][-1])  # the last step's buckets went around rank 1


def test_after_a_failure_every_queued_bucket_fails_at_once():
    ad = AdaptiveAllreduce(None, rank=0, world=2, timeout_s=30)
    ad.tp.broken = "send with rank 1: connection closed"
    ours = BucketedAllreduce(ad)
    try:
        pend = [ours.allreduce_start(torch.ones(1000), what=f"bucket {i}") for i in range(3)]
        for p in pend:
            assert p.done.wait(5)
            with pytest.raises(CollectiveError, match="already failed"):
                ours.finish(p)
        with pytest.raises(ValueError, match="sum only"):
            ours.allreduce_start(torch.ones(3), op=torch.distributed.ReduceOp.MAX)
    finally:
        ours.close()
    assert ours._thread is None



def test_a_newer_generation_ends_the_wait_at_once():
    import threading

    from unbroken.comm.group import GenerationChanged, Pending

    newer = threading.Event()
    ours = BucketedAllreduce(AdaptiveAllreduce(None, rank=0, world=2, timeout_s=30), interrupted=newer.is_set)
    p = Pending("bucket 0")  # never started: only the generation can end the wait
    threading.Timer(0.05, newer.set).start()
    with pytest.raises(GenerationChanged, match="newer generation"):
        ours.finish(p)
    ours.close()
