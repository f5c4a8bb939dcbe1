"""Step-addressed data loading: this rank's batch is a pure function of the global step.

`StepLoader` replaces the usual `DataLoader` + `DistributedSampler` loop. Under unbroken the
training loop runs global steps 1, 2, 3, ...; after a rollback the step number jumps back, and a
replacement process may join at any step. `StepLoader.batch(step)` returns exactly the batch the
plain loop

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=sampler_drop_last)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, ...)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader: ...

would give at that step (step 1 = epoch 0's first batch, step len(loader) + 1 = epoch 1's first),
without replaying the steps before it. This module owns only the index arithmetic (a copy of
DistributedSampler's permutation, cached per epoch) and the lifetime of one torch DataLoader
iterator that prefetches the steps ahead; fetching, collation, pinning and worker processes are
torch's own.

Randomness. Index order depends only on (seed, epoch, step, rank, world_size). Random transforms
inside `dataset[i]` are another matter:
  * num_workers == 0: they run in the calling process on its global RNGs, as with a DataLoader.
  * num_workers > 0: each iterator's workers are seeded from a generator seeded with
    (seed, rank, start step), never from the global RNG, so a run is reproducible. But a
    worker's RNG state at step t depends on where its iterator started and on which batches it
    served before t: after a rollback to step t, or in a process that joins at t, the batch at
    t has the same samples as the uninterrupted run but, in general, different random
    augmentations (they match a fresh StepLoader started at t with the same num_workers).
    Transforms that must be exactly reproducible per sample should derive their randomness
    from the sample index (and epoch) rather than from the worker's RNG.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

__all__ = ["StepLoader"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_args(dataset: Any, batch_size: int, rank: int, world_size: int,
                num_workers: int) -> int:
    """Validate the constructor's arguments; return len(dataset)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}: pass a positive batch_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}: pass the number of ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}: "
                         "pass this process's rank in the job")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}: "
                         "use 0 to load in the calling process")
    if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError("dataset must be map-style (with __len__ and __getitem__); iterable-style "
                         "datasets are not supported because a batch must be addressable by step: "
                         "materialize the stream or wrap it in an indexable dataset")
    n, global_batch = len(dataset), batch_size * world_size
    if n < global_batch:
        raise ValueError(f"dataset has {n} samples, fewer than one global batch (batch_size "
                         f"{batch_size} x world_size {world_size} = {global_batch}): "
                         "use a smaller batch_size or more data")
    return n


class _Plan:
    """DistributedSampler's index order for one rank, batched and addressed by global step."""

    def __init__(self, n: int, *, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool, drop_last: bool, sampler_drop_last: bool) -> None:
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        if sampler_drop_last and n % world_size:
            num_samples = _ceil_div(n - world_size, world_size)
        else:
            num_samples = _ceil_div(n, world_size)
        self.total_size = num_samples * world_size
        self.batches = (num_samples // batch_size if drop_last
                        else _ceil_div(num_samples, batch_size))
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> this rank's samples, at most 2 kept

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for `epoch`, in DistributedSampler.__iter__ order."""
        cached = self._orders.get(epoch)
        if cached is not None:
            return cached
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        # Repeating the permutation and cutting at total_size is both of the sampler's cases:
        # padding by repetition (total_size > n) and dropping the tail (total_size <= n).
        full = perm.repeat(_ceil_div(self.total_size, self.n))[: self.total_size]
        mine = full[self.rank:: self.world_size].clone()
        if len(self._orders) >= 2:
            self._orders.pop(next(iter(self._orders)))
        self._orders[epoch] = mine
        return mine

    def indices(self, step: int) -> list[int]:
        epoch, pos = divmod(step - 1, self.batches)
        b = self.batch_size
        return self.order(epoch)[pos * b:(pos + 1) * b].tolist()


class _StepBatchSampler(Sampler[list[int]]):
    """Yields the plan's index lists for steps start, start + 1, ... (without end)."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.start = 1

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.plan.indices(step)
            step += 1


def _worker_seed(seed: int, rank: int, start: int) -> int:
    digest = hashlib.blake2b(f"unbroken.StepLoader/{seed}/{rank}/{start}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class StepLoader:
    """This rank's batches, addressed by 1-based global step (see the module docstring).

    Asking for the step after the previous one takes the batch from a running DataLoader
    iterator (prefetched by its workers when num_workers > 0); any other step (a rollback, a
    new start, a skip) stops that iterator and starts a new one at the requested step.
    `close()` (also on `with` exit and on garbage collection) stops the workers; a later
    `batch()` starts new ones.
    """

    def __init__(self, dataset: Any, *, batch_size: int, rank: int, world_size: int,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 sampler_drop_last: bool = False, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False,
                 prefetch_factor: int | None = None,
                 worker_init_fn: Callable | None = None) -> None:
        self._it: Iterator | None = None
        n = _check_args(dataset, batch_size, rank, world_size, num_workers)
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0: leave prefetch_factor None "
                             "or set num_workers")
        self.dataset, self.batch_size, self.rank, self.world_size = \
            dataset, batch_size, rank, world_size
        self.seed, self.num_workers = seed, num_workers
        self._plan = _Plan(n, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed,
                           shuffle=shuffle, drop_last=drop_last,
                           sampler_drop_last=sampler_drop_last)
        self._steps = _StepBatchSampler(self._plan)
        self._generator = torch.Generator()
        self._loader = DataLoader(
            dataset, batch_sampler=self._steps, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn, generator=self._generator, persistent_workers=False)
        self._next_step = 0  # the step self._it yields next

    def __len__(self) -> int:
        return self._plan.batches

    def epoch_of(self, step: int) -> int:
        return (self._check_step(step) - 1) // self._plan.batches

    def indices(self, step: int) -> list[int]:
        return self._plan.indices(self._check_step(step))

    def batch(self, step: int) -> Any:
        step = self._check_step(step)
        if self._it is None or step != self._next_step:
            self._start(step)
        try:
            out = next(self._it)
        except BaseException:
            self.close()  # the iterator's position is unknown now; the next call restarts
            raise
        self._next_step = step + 1
        return out

    def close(self) -> None:
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _start(self, step: int) -> None:
        self.close()
        self._steps.start = step
        # The iterator draws its workers' base seed from this generator when it is created.
        self._generator.manual_seed(_worker_seed(self.seed, self.rank, step))
        self._it = iter(self._loader)
        self._next_step = step

    @staticmethod
    def _check_step(step: int) -> int:
        step = operator.index(step)
        if step < 1:
            raise ValueError(f"step must be >= 1 (global steps are 1-based), got {step}")
        return step

    def __enter__(self) -> StepLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
