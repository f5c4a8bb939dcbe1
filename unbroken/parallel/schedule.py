"""Which hyperparameters step t uses: the user's param groups, moved by their lr scheduler.

Without a scheduler, step t uses what the optimizer's param groups hold when the step
runs (a script that sets `group["lr"] = get_lr(step)` in its loop, as nanoGPT does, works
unchanged: the value is a function of the step). With one, unbroken steps it once per
step (or once per `every` steps: per epoch) instead of the script, so the schedule is a
function of the step number too: a process that joins at step t advances a fresh
scheduler to t, and a rollback rewinds it (the values of recent steps are cached; older
ones are recomputed from the scheduler's initial state). The script's own
`scheduler.step()` calls become no-ops, checked against that cadence where the process
saw every step. A scheduler whose next value depends on something else
(`ReduceLROnPlateau` reads a metric) is refused.
"""
from __future__ import annotations

import copy
import warnings

import torch

from unbroken.parallel.optim import ChunkOptimizer

CACHE_STEPS = 4096  # hyperparameters of this many recent steps are kept (a redo or rollback reuses them)


class ScheduleError(ValueError):
    """The scheduler cannot be driven by step number (wrong optimizer, metric-driven, stepped twice)."""


def check_scheduler(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Refuse a scheduler unbroken cannot drive, or a scheduler attached but not handed over."""
    if scheduler is None:
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            raise ScheduleError("a learning-rate scheduler is attached to this optimizer: pass it as "
                                "unbroken.Trainer(model, optimizer, scheduler) and remove scheduler.step() from the "
                                "loop (unbroken steps it once per step, also for a process that joins later)")
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ScheduleError("ReduceLROnPlateau is driven by a metric, not by the step number, so a replacement "
                            "process cannot reproduce it; use a step-based scheduler (e.g. LambdaLR)")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ScheduleError(f"scheduler must be a torch.optim.lr_scheduler scheduler, got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ScheduleError("the scheduler was built for another optimizer: build it from the optimizer you pass "
                            "to unbroken.Trainer")


class ScheduleClock:
    def __init__(self, chunk_opt: ChunkOptimizer, scheduler=None, every: int = 1) -> None:
        check_scheduler(chunk_opt.optimizer, scheduler)
        self.opt, self.scheduler = chunk_opt, scheduler
        self.every = every  # steps per scheduler.step()
        self._done = 0  # scheduler.step() calls made so far
        self._cache: dict[int, list[dict]] = {}
        if scheduler is not None:
            self._initial_sched = copy.deepcopy(scheduler.state_dict())
            self._initial_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                                    for g in chunk_opt.optimizer.param_groups]
            self._epoch = scheduler.last_epoch
            self._step = scheduler.step  # ours; the script's calls go to `script_step`
            scheduler.step = self.script_step
            self._script_calls, self._script_from = 0, None

    def set_every(self, every: int, at_step: int) -> None:
        """A new cadence (per epoch once the epoch length is known); groups moved to `at_step`."""
        if every != self.every:
            self.every = every
            self._cache.clear()
            self.move_to(at_step)

    def script_step(self, *args, **kwargs) -> None:
        """The script's scheduler.step(): a no-op (unbroken steps the scheduler), checked: in a
        process that has seen every step since 0, its k-th call must come after k * every steps."""
        self._script_calls += 1
        if self._script_from is None or self._script_from[0] != 0:
            return  # joined later: its loop may pass epochs already done
        done, refuse = self._script_from[1](), self._script_from[2]
        if done != self._script_calls * self.every:
            refuse(f"the script called scheduler.step() for the {self._script_calls}. time after {done} steps, but "
                   f"unbroken steps it every {self.every} step(s): pass scheduler_step='epoch' (or the number of "
                   "steps per scheduler step) to unbroken.Trainer")

    def started_at(self, step: int, steps_done, refuse) -> None:
        """The process trains from `step` on (0: it has seen every step); `steps_done()` counts the
        committed steps, `refuse(message)` stops the job."""
        if self.scheduler is not None and self._script_from is None:
            self._script_from = (step, steps_done, refuse)

    def hyper_for(self, step: int) -> list[dict]:
        """Every param group's hyperparameters for `step`."""
        if self.scheduler is None:
            return self.opt.hyper_now()
        if step in self._cache:
            return self._cache[step]
        self.move_to(step)
        hyper = self._cache[step] = self.opt.hyper_now()
        if len(self._cache) > CACHE_STEPS:
            del self._cache[min(self._cache)]
        return hyper

    def move_to(self, step: int) -> None:
        """Put the scheduler (and the groups it sets) where step `step` reads them."""
        sched = self.scheduler
        if sched is None:
            return
        if sched.last_epoch != self._epoch:
            raise ScheduleError("the scheduler was stepped outside unbroken (not through scheduler.step()); "
                                "unbroken steps the scheduler passed to Trainer: leave it alone")
        target = (step - 1) // self.every
        if target < self._done:
            self._rewind()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": we never call the latter
            while self._done < target:
                self._step()
                self._done += 1
        self._epoch = sched.last_epoch

    def _rewind(self) -> None:
        for group, saved in zip(self.opt.optimizer.param_groups, self._initial_groups):
            group.update(copy.deepcopy(saved))
        self.scheduler.load_state_dict(copy.deepcopy(self._initial_sched))
        self._done = 0
