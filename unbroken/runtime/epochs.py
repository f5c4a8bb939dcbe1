"""`trainer.loader(...)`: a StepLoader a training loop can iterate the way it iterates a DataLoader.

    loader = trainer.loader(dataset, batch_size=32)     # replaces DataLoader(..., sampler=DistributedSampler(...))
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)                 # accepted, as DistributedSampler's
        for x, y in loader:                             # the batch of step trainer.step_count + 1
            trainer.step(lambda: loss_fn(model(x), y))

Iterating yields the batch of the trainer's next step until the end of the epoch the loop
is in (the one `set_epoch` named, else the epoch of the next step), so the loop follows
the step count, never a private cursor: after a rollback the same batches come again,
and a process that joins at step t skips the epochs already done and starts at t's batch.
`loader.batch(step)` is the random-access form.
"""
from __future__ import annotations


class _EpochSetter:
    """Stands in for DistributedSampler: remembers the epoch the loop says it is in."""

    def __init__(self) -> None:
        self.epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


class TrainerLoader:
    def __init__(self, steps, trainer) -> None:
        self.steps, self.trainer = steps, trainer
        self.sampler = _EpochSetter()
        self.batch_size = steps.batch_size

    def __len__(self) -> int:
        return len(self.steps)

    def batch(self, step: int):
        return self.steps.batch(step)

    def epoch_of(self, step: int) -> int:
        return self.steps.epoch_of(step)

    def close(self) -> None:
        self.steps.close()

    def __iter__(self):
        epoch = self.sampler.epoch
        if epoch is None:
            epoch = self.steps.epoch_of(self.trainer.step_count + 1)
        self.sampler.epoch = None  # one set_epoch per pass, as a DataLoader loop does
        for t in self.trainer.steps_until((epoch + 1) * len(self)):
            yield self.steps.batch(t)
