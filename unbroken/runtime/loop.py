"""The loop-facing half of `Trainer`: the step sequence, the data loader, DDP's surface.

`steps()` is the step count's one source of truth (`--steps`, else the script's number);
`loader()` gives batches by step number; and a Trainer stands where the script had
`DDP(model)`: callable, with `.module`, `.train()`, `.eval()`, `.parameters()`,
`.state_dict()`. The update and recovery half is `runtime/worker.py`.
"""
from __future__ import annotations

import torch.nn as nn

from unbroken.runtime.determinism import BATCH, seed_everything


class LoopAPI:
    def steps(self, total: int | None = None):
        """Yield the next step number until the job's step count is done: `--steps` (or the config
        file's `steps`); `total` when the run did not set one. A `total` that disagrees with
        `--steps` stops the job (exit 2). Before yielding step t, Python's, NumPy's and torch's
        global generators are seeded from (seed, t, rank): batches drawn from them replay."""
        total = self._plan(total)
        while self.st.step_count < total:
            t = self.st.step_count + 1
            seed_everything(self.cfg.seed, t, self.rank, BATCH)
            yield t

    def _plan(self, total) -> int:
        cfg = self.cfg
        if total is None:
            total = cfg.steps
        elif isinstance(total, bool) or not isinstance(total, int) or total < 1:
            self._refuse(f"trainer.steps({total!r}): the step count must be an integer >= 1")
        elif cfg.steps_given and total != cfg.steps:
            self._refuse(f"trainer.steps({total}) disagrees with --steps {cfg.steps}: call trainer.steps() "
                         "without an argument (it takes --steps) or pass the same number")
        if self._planned != total and self.rank == 0 and self.ctx.role == "worker":
            self.ctx.events.emit("steps_planned", steps=total, source="config" if total == cfg.steps else "script")
        self._planned = total
        return total

    def loader(self, dataset, *, batch_size: int, shuffle: bool = True, drop_last: bool = False, **kwargs):
        """This rank's batches of `dataset` by step number, in DataLoader + DistributedSampler order
        (seeded by --seed): `batch = loader.batch(step)`; `len(loader)` batches per epoch."""
        from unbroken.data import StepLoader
        from unbroken.runtime.epochs import TrainerLoader

        try:
            steps = StepLoader(dataset, batch_size=batch_size, rank=self.rank, world_size=self.world_size,
                               seed=kwargs.pop("seed", self.cfg.seed), shuffle=shuffle, drop_last=drop_last, **kwargs)
        except (TypeError, ValueError) as e:
            self._refuse(f"trainer.loader: {e}")
        if self.scheduler_step == "epoch":
            self.clock.set_every(len(steps), self.st.step_count + 1)
        return TrainerLoader(steps, self)

    def steps_until(self, end: int):
        """Step numbers up to `end` (and the job's step count), seeded as steps() seeds them; for
        a loader iterated like a DataLoader (runtime/epochs.py)."""
        limit = min(end, self.cfg.steps) if self.cfg.steps_given else end
        while self.st.step_count < limit:
            t, before = self.st.step_count + 1, self._attempts
            seed_everything(self.cfg.seed, t, self.rank, BATCH)
            yield t
            if self._attempts == before:
                self._refuse(f"the loop took step {t}'s batch but did not call trainer.step(...) with it: every "
                             "batch of trainer.loader(...) must be trained with trainer.step")

    # --- DDP's surface: `model = unbroken.Trainer(model, ...)` where a script had DDP(model)
    @property
    def module(self) -> nn.Module:
        return self.model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> "LoopAPI":
        self.model.train(mode)
        return self

    def eval(self) -> "LoopAPI":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)
