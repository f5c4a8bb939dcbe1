"""The reallocation policy of the dynamic method. After each training step it looks at the last
few steps: the busy process-seconds each pool spent per step (the work), and each pool's idle
fraction. It predicts the step time of a split r rollout / N-r training processes and moves the
processes to the split with the shortest predicted step when that beats the current one by
`gain` (all in one move: one new training generation); at most one move every `cooldown` steps.
At least one process stays in the training pool, and one in the rollout pool, except on-policy
with lending (below), where the trainers can do all the generating.

The prediction depends on whether the pools overlap. With staleness 1 they do (the rollout pool
samples step s+1 while step s trains): without lending, max(rollout work / r, training work /
(N - r)), each pool working alone; with lending (the coordinator's dynamic mode: idle trainers
generate groups of the step that training waits for), max(training work / (N - r), all work / N):
the trainers must get through the training, and beyond that every process is busy. On-policy
(staleness 0) generation and training alternate, so a step is the sum of the two phases: rollout
work / r + training work / (N - r), or with lending rollout work / N + training work / (N - r)
(every process generates, then the trainers train): every process a trainer (r = 0) predicts the
shortest step, and it is what time-sharing does. It is allowed there alone: with staleness 1 an
empty rollout pool would leave nobody generating ahead. Among splits that predict the same step,
the one with the fewest trainers is taken (a trainer can lend a hand to the rollout pool; a
rollout worker joins training only as a helper, through the store)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    step: int
    rollout: int           # processes in the rollout pool (those already moving out excluded)
    train: int
    rollout_work_s: float  # busy process-seconds of the rollout pool per step, over the window
    train_work_s: float
    rollout_idle: float    # idle fraction of each pool over the window (reported with a move)
    train_idle: float
    queued: int            # prompt groups generated ahead and waiting for training


@dataclass(frozen=True)
class Move:
    to_pool: str           # "train" | "rollout"
    reason: str
    count: int = 1         # processes that move (into one new training generation)


def predicted_step_s(obs: Observation, rollout: int, lending: bool = False, overlap: bool = True) -> float:
    n = obs.rollout + obs.train
    generate = obs.rollout_work_s / (n if lending else rollout)
    train = obs.train_work_s / (n - rollout)
    if not overlap:
        return generate + train
    if lending:
        return max(train, (obs.rollout_work_s + obs.train_work_s) / n)
    return max(generate, train)


@dataclass
class Controller:
    gain: float = 0.10
    cooldown: int = 2
    lending: bool = True
    overlap: bool = True  # the pools work at once (staleness 1); False: on-policy, they alternate
    _last: int = -10**9

    def decide(self, obs: Observation) -> Move | None:
        n = obs.rollout + obs.train
        if obs.step - self._last < self.cooldown or n < 2 or obs.rollout_work_s + obs.train_work_s <= 0:
            return None

        def pred(r: int) -> float:
            return predicted_step_s(obs, r, self.lending, self.overlap)

        now = pred(obs.rollout)
        fewest = 0 if self.lending and not self.overlap else 1
        best = min(range(fewest, n), key=lambda r: (pred(r), -r))
        if best == obs.rollout or pred(best) > (1 - self.gain) * now:
            return None
        self._last = obs.step
        to = "rollout" if best > obs.rollout else "train"
        why = (f"work per step: rollout {obs.rollout_work_s:.3f} s, training {obs.train_work_s:.3f} s; "
               f"{best} rollout processes predict {pred(best):.3f} s/step vs {now:.3f} "
               f"(idle: rollout {obs.rollout_idle:.2f}, training {obs.train_idle:.2f}; {obs.queued} groups queued)")
        return Move(to, why, count=abs(best - obs.rollout))
