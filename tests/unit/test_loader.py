"""StepLoader (unbroken/data/loader.py) against the plain DistributedSampler + DataLoader loop."""
import multiprocessing
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from unbroken.data import StepLoader


class IndexDataset:
    """Sample i is i (so a batch's collated value is its indices)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class DictDataset:
    """Nested samples (dict of tensors, tuple, int, float) to exercise default_collate."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 3, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "pair": (self.y[i], i), "w": float(i) / 3}


class NoisyDataset:
    """A random transform drawn from the worker's torch RNG."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.rand(2) + i


def plain_loop(dataset, *, batch_size, rank, world_size, seed=0, shuffle=True, drop_last=False,
               sampler_drop_last=False, epochs=1, collate_fn=None):
    """The batches a plain PyTorch loop sees, in order: step 1, 2, 3, ..."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=sampler_drop_last)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                        collate_fn=collate_fn)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.extend(loader)
    return out, len(loader)


def assert_same(a, b):
    """Structural, bitwise equality of two collated batches."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def child_pids():
    """Live child processes of this process (per /proc), zombies excluded."""
    me, pids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def no_new_children(before):
    return not multiprocessing.active_children() and child_pids() <= before


@st.composite
def configs(draw):
    world_size = draw(st.integers(1, 5))
    batch_size = draw(st.integers(1, 7))
    return dict(
        n=batch_size * world_size + draw(st.integers(0, 40)),
        batch_size=batch_size, world_size=world_size,
        rank=draw(st.integers(0, world_size - 1)),
        seed=draw(st.integers(0, 2**31)),
        shuffle=draw(st.booleans()), drop_last=draw(st.booleans()),
        sampler_drop_last=draw(st.booleans()),
    )


@settings(max_examples=300)
@given(cfg=configs(), epoch=st.integers(0, 6))
def test_indices_equal_distributed_sampler_at_any_epoch(cfg, epoch):
    n = cfg.pop("n")
    ds = IndexDataset(n)
    sl = StepLoader(ds, **cfg)
    sampler = DistributedSampler(ds, num_replicas=cfg["world_size"], rank=cfg["rank"],
                                 shuffle=cfg["shuffle"], seed=cfg["seed"],
                                 drop_last=cfg["sampler_drop_last"])
    sampler.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler,
                        drop_last=cfg["drop_last"], collate_fn=list)
    assert len(sl) == len(loader) >= 1
    first = epoch * len(sl) + 1
    for i, want in enumerate(loader):
        assert sl.indices(first + i) == want
        assert sl.epoch_of(first + i) == epoch
    assert sl.epoch_of(first + len(sl)) == epoch + 1


@settings(max_examples=60)
@given(cfg=configs(), order_seed=st.integers(0, 1000))
def test_batches_equal_plain_loop_in_order_and_in_any_order(cfg, order_seed):
    n = cfg.pop("n")
    ds = IndexDataset(n)
    want, per_epoch = plain_loop(ds, epochs=3, **cfg)
    sl = StepLoader(ds, **cfg)
    assert len(sl) == per_epoch
    for step, b in enumerate(want, start=1):
        assert_same(sl.batch(step), b)
    steps = list(range(1, len(want) + 1))
    random.Random(order_seed).shuffle(steps)  # rollbacks and jumps
    for step in steps:
        assert_same(sl.batch(step), want[step - 1])
        assert sl.indices(step) == want[step - 1].tolist()


@pytest.mark.parametrize("world_size,rank,batch_size,drop_last,sampler_drop_last", [
    (1, 0, 4, False, False), (3, 2, 4, True, False), (4, 1, 3, False, True), (2, 0, 5, True, True),
])
def test_nested_batches_bitwise_equal_default_and_custom_collate(world_size, rank, batch_size,
                                                                drop_last, sampler_drop_last):
    ds = DictDataset(37)
    kw = dict(batch_size=batch_size, rank=rank, world_size=world_size, seed=7,
              drop_last=drop_last, sampler_drop_last=sampler_drop_last)
    for collate in (None, list):
        want, _ = plain_loop(ds, epochs=2, collate_fn=collate, **kw)
        with StepLoader(ds, collate_fn=collate, **kw) as sl:
            for step in [*range(1, len(want) + 1), 3, 1, len(want), 2]:
                assert_same(sl.batch(step), want[step - 1])


def test_new_process_at_step_t_draws_the_lost_ranks_batch():
    ds = IndexDataset(50)
    kw = dict(batch_size=4, world_size=3, seed=11)
    for rank in range(3):
        want, per_epoch = plain_loop(ds, rank=rank, epochs=4, **kw)
        t = 2 * per_epoch + 2
        joiner = StepLoader(ds, rank=rank, **kw)  # starts cold at t
        assert joiner.epoch_of(t) == 2
        assert_same(joiner.batch(t), want[t - 1])
        assert_same(joiner.batch(t + 1), want[t])


def test_ranks_partition_each_epoch_like_the_sampler():
    ds, kw = IndexDataset(30), dict(batch_size=2, world_size=4, seed=3)
    loaders = [StepLoader(ds, rank=r, **kw) for r in range(4)]
    per_epoch = len(loaders[0])
    for epoch in range(3):
        seen = [i for sl in loaders for s in range(1, per_epoch + 1)
                for i in sl.indices(epoch * per_epoch + s)]
        assert len(seen) == 32 and set(seen) == set(range(30))  # 2 padded by repetition
    assert loaders[0].indices(1) != loaders[0].indices(per_epoch + 1)  # reshuffled per epoch
    assert len(loaders[0]._plan._orders) <= 2  # only the current and one other epoch cached


def test_global_rng_untouched():
    sl = StepLoader(DictDataset(20), batch_size=3, rank=1, world_size=2, seed=5)
    state = torch.get_rng_state()
    for step in (1, 2, 9, 4, 5):
        sl.batch(step)
        sl.indices(step)
    assert torch.equal(torch.get_rng_state(), state)


def test_unshuffled_order_is_the_dataset_order():
    sl = StepLoader(IndexDataset(10), batch_size=2, rank=1, world_size=2, shuffle=False)
    # rank 1 of 2 takes samples 1, 3, 5, 7, 9; the short last batch ends the epoch
    assert [sl.indices(s) for s in (1, 2, 3, 4)] == [[1, 3], [5, 7], [9], [1, 3]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize("kwargs,dataset,match", [
    (dict(batch_size=0), IndexDataset(10), "batch_size must be >= 1"),
    (dict(world_size=0, rank=0), IndexDataset(10), "world_size must be >= 1"),
    (dict(rank=2), IndexDataset(10), r"rank must be in \[0, world_size=2\)"),
    (dict(rank=-1), IndexDataset(10), r"rank must be in \[0, world_size=2\)"),
    (dict(num_workers=-1), IndexDataset(10), "num_workers must be >= 0"),
    (dict(prefetch_factor=2), IndexDataset(10), "prefetch_factor needs num_workers > 0"),
    ({}, Stream(), "iterable-style datasets are not supported"),
    ({}, iter(range(10)), "iterable-style datasets are not supported"),
    (dict(batch_size=4, world_size=4, rank=0), IndexDataset(10),
     r"dataset has 10 samples, fewer than one global batch \(batch_size 4 x world_size 4 = 16\): "
     "use a smaller batch_size or more data"),
    (dict(batch_size=3, drop_last=True, sampler_drop_last=True), IndexDataset(5),
     r"fewer than one global batch \(batch_size 3 x world_size 2 = 6\)"),
])
def test_bad_arguments_raise_one_line_value_errors(kwargs, dataset, match):
    kw = dict(batch_size=1, rank=0, world_size=2) | kwargs
    with pytest.raises(ValueError, match=match) as info:
        StepLoader(dataset, **kw)
    assert "\n" not in str(info.value) and ": " in str(info.value)


def test_bad_step_raises():
    sl = StepLoader(IndexDataset(4), batch_size=1, rank=0, world_size=2)
    for call in (sl.batch, sl.indices, sl.epoch_of):
        with pytest.raises(ValueError, match="step must be >= 1"):
            call(0)
    assert sl.indices(1) == sl.indices(torch.tensor(1))  # any integer-like step


def test_exactly_one_global_batch_is_enough():
    sl = StepLoader(IndexDataset(6), batch_size=3, rank=1, world_size=2, drop_last=True)
    assert len(sl) == 1 and sl.epoch_of(2) == 1 and len(sl.indices(2)) == 3


# -- worker processes ---------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_give_the_plain_loop_batches_across_rollbacks(num_workers):
    before = child_pids()
    ds = DictDataset(26)
    kw = dict(batch_size=3, rank=1, world_size=2, seed=2)
    want, per_epoch = plain_loop(ds, epochs=2, **kw)
    sl = StepLoader(ds, num_workers=num_workers, prefetch_factor=2, **kw)
    steps = [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7, 8, 2 * per_epoch, 1]  # rollback to 3, jumps
    for step in steps:
        assert_same(sl.batch(step), want[step - 1])
    assert child_pids() - before  # workers are running
    sl.close()
    assert no_new_children(before)
    assert_same(sl.batch(5), want[4])  # usable after close: starts new workers
    sl.close()
    sl.close()  # idempotent
    assert no_new_children(before)


def test_worker_randomness_is_a_function_of_seed_rank_and_start_step():
    before = child_pids()
    kw = dict(batch_size=2, rank=0, world_size=2, seed=9, num_workers=2)
    torch.manual_seed(0)
    with StepLoader(NoisyDataset(), **kw) as a:
        run_a = [a.batch(s) for s in (1, 2, 3, 4, 5)]
        redo_a = [a.batch(s) for s in (3, 4, 5)]  # rollback to 3
    torch.manual_seed(12345)  # the global RNG does not matter
    with StepLoader(NoisyDataset(), **kw) as b:
        run_b = [b.batch(s) for s in (1, 2, 3, 4, 5)]
    with StepLoader(NoisyDataset(), **kw) as c:  # a process that joins at step 3
        join_c = [c.batch(s) for s in (3, 4, 5)]
    assert_same(run_a, run_b)
    assert_same(redo_a, join_c)
    # same samples as the uninterrupted run; augmentations differ (the documented caveat)
    assert all(torch.equal(x.floor(), y.floor()) for x, y in zip(redo_a, run_a[2:]))
    assert not torch.equal(redo_a[0], run_a[2])
    with StepLoader(NoisyDataset(), **(kw | {"rank": 1})) as d:
        assert not torch.equal(d.batch(1).frac(), run_a[0].frac())
    assert no_new_children(before)


def _record_worker(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.tag = f"w{worker_id}"


class TaggedDataset(IndexDataset):
    tag = "main"

    def __getitem__(self, i):
        return self.tag


def test_worker_init_fn_runs_in_workers_and_del_reaps_them():
    before = child_pids()
    sl = StepLoader(TaggedDataset(8), batch_size=2, rank=0, world_size=1, num_workers=1,
                    worker_init_fn=_record_worker, collate_fn=list)
    assert sl.batch(1) == ["w0", "w0"]
    assert child_pids() - before
    del sl
    assert no_new_children(before)


def test_dataset_error_propagates_and_next_call_restarts():
    class Flaky(IndexDataset):
        fail = {5}

        def __getitem__(self, i):
            if i in self.fail:
                raise KeyError(i)
            return i

    before = child_pids()
    with StepLoader(Flaky(12), batch_size=2, rank=0, world_size=1, shuffle=False,
                    num_workers=1, collate_fn=list) as sl:
        assert sl.batch(1) == [0, 1] and sl.batch(2) == [2, 3]
        with pytest.raises(KeyError):
            sl.batch(3)
        assert no_new_children(before)
        assert sl.batch(4) == [6, 7] and sl.batch(5) == [8, 9]
    assert no_new_children(before)
