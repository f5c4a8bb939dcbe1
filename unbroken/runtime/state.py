"""`TrainState`: where a Trainer's training is — the one record that recovery reads and moves.

The Trainer owns it; `runtime.recovery` receives it (inside `RecoveryInputs`) and is the
only other code that changes it, so data flows one way: worker -> recovery -> protect.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from unbroken.protect.txn import StepScalars


@dataclass
class TrainState:
    step_count: int = 0                 # the last committed step
    grads_step: int | None = None       # the step whose averaged gradient flat.grads holds
    local_step: int | None = None       # the step whose local (not yet averaged) gradient is kept
    gathering_step: int | None = None   # the last step whose parameter all-gather this rank entered
    scalars: StepScalars | None = None  # the global scalars of grads_step
    last_loss: float = math.nan
    has_state: bool | None = True       # False: a new member without state yet; None: a shadow
    deferred: Any = None                # recovery.DeferredDecode still running (its first step ends it)
    parity_rebuilt: str | None = None   # how the last recovery restored tier-1 parity
    steps_replayed: int = 0             # steps the last recovery replayed the lost shard
    redo_since: float | None = None     # a recovery's end, until the first step completes


@dataclass
class RecoveryInputs:
    """Everything recovery works with, passed explicitly by the Trainer (no Trainer import)."""

    ctx: Any                  # runtime.context.ProcessContext
    cfg: Any                  # config.RunConfig
    st: TrainState
    owned: Any                # parallel.strategy.OwnedState
    tuner: Any                # runtime.autok.IntervalTuner
    ckpt: Any                 # protect.tier2.CheckpointWriter or None
    watch: Any                # membership.GenerationWatch
    rank: int
    world_size: int
    join: Callable            # join(generation): build its groups
    groups: Callable          # () -> (world Comm, parity-group Comm, Generation)
    point: Callable           # fault-injection point(phase, step)
    report: Callable          # report(step, error): a failed collective

    @property
    def comm(self):
        return self.groups()[0]

    @property
    def group(self):
        return self.groups()[1]

    @property
    def gen(self):
        return self.groups()[2]
