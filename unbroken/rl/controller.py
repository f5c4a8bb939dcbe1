"""The reallocation policy of the dynamic method: after each training step it compares the pools'
idle fractions since its last move and moves one process from the idler pool to the busier one
(a rollout worker becomes a trainer rank, or a trainer rank becomes a rollout worker), keeping at
least one process in each pool and waiting `cooldown` steps between moves."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    step: int
    rollout: int          # processes in the rollout pool (those already moving out excluded)
    train: int
    rollout_idle: float   # idle fraction of the rollout pool since the last decision
    train_idle: float
    queued: int           # prompt groups generated ahead and waiting for training


@dataclass(frozen=True)
class Move:
    to_pool: str          # "train" | "rollout"
    reason: str


@dataclass
class Controller:
    margin: float = 0.15
    cooldown: int = 2
    _last: int = -10**9

    def decide(self, obs: Observation) -> Move | None:
        if obs.step - self._last < self.cooldown:
            return None
        gap = obs.rollout_idle - obs.train_idle
        move = None
        if gap > self.margin and obs.rollout > 1:
            move = Move("train", f"rollout pool idle {obs.rollout_idle:.2f} > training pool idle "
                                 f"{obs.train_idle:.2f} ({obs.queued} groups queued for training)")
        elif -gap > self.margin and obs.train > 1:
            move = Move("rollout", f"training pool idle {obs.train_idle:.2f} > rollout pool idle "
                                   f"{obs.rollout_idle:.2f} (trainers wait for samples)")
        if move is not None:
            self._last = obs.step
        return move
