"""RLConfig: the task, the policy, GRPO and the pools of one RL run (frozen, validated at construction)."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

from unbroken.rl.errors import RLInputError

LENGTHS = ("longtail", "uniform")
METHODS = ("static", "colocated", "dynamic")


def max_processes() -> int:
    """The most worker processes this machine allows: four per CPU core (they mostly wait on each other)."""
    return 4 * (os.cpu_count() or 1)


def _int(name: str, v: object, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RLInputError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """Task: `digits`-digit addition; `lengths` "longtail" asks for the answer repeated k times with
    k heavy-tailed in 1..max_repeat, "uniform" always k=1. GRPO: `prompts` per step, `group` samples
    per prompt, `epochs` optimizer steps on each step's samples (the ratio is clipped from the second on), `clip` ratio, `kl` weight to the pre-trained reference (0 = off). Pools: `processes`
    in all, `rollout` of them generating (static/dynamic start), `staleness` 0 or 1 (how many updates
    older than the one being trained the sampling weights may be)."""
    digits: int = 2
    lengths: str = "longtail"
    max_repeat: int = 6
    prompts: int = 8
    group: int = 8
    steps: int = 30
    epochs: int = 1
    lr: float = 3e-4
    clip: float = 0.2
    kl: float = 0.0
    temperature: float = 1.0
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    pretrain_steps: int = 300
    pretrain_batch: int = 64
    pretrain_lr: float = 3e-3
    pretrain_noise: float = 0.5
    processes: int = 4
    rollout: int = 2
    staleness: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise RLInputError(f"--lengths must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        for name, lo in (("digits", 1), ("max_repeat", 1), ("prompts", 1), ("group", 2), ("steps", 1), ("epochs", 1),
                         ("n_layer", 1), ("n_head", 1), ("n_embd", 1), ("pretrain_steps", 0),
                         ("pretrain_batch", 1), ("seed", 0)):
            _int(name, getattr(self, name), lo)
        if self.digits > 4:
            raise RLInputError(f"--digits must be <= 4 (a tiny model on a CPU), got {self.digits}")
        if self.n_embd % self.n_head:
            raise RLInputError(f"--n-embd ({self.n_embd}) must be divisible by --n-head ({self.n_head})")
        for name in ("lr", "pretrain_lr", "temperature"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise RLInputError(f"--{name.replace('_', '-')} must be a number > 0, got {v!r}")
        if not 0 <= self.pretrain_noise <= 1:
            raise RLInputError(f"--pretrain-noise must be in [0, 1], got {self.pretrain_noise!r}")
        if not 0 < self.clip < 1:
            raise RLInputError(f"--clip must be in (0, 1), got {self.clip!r}")
        if not (isinstance(self.kl, (int, float)) and self.kl >= 0):
            raise RLInputError(f"--kl must be >= 0 (0 = no KL to the reference), got {self.kl!r}")
        if self.staleness not in (0, 1):
            raise RLInputError(f"--staleness must be 0 (on-policy) or 1 (one update behind), got {self.staleness!r}")
        self.check_pools(self.processes, self.rollout)

    @staticmethod
    def check_pools(processes: int, rollout: int) -> None:
        _int("processes", processes, 1)
        limit = max_processes()
        if processes > limit:
            raise RLInputError(f"--processes {processes} is more than this machine's limit of {limit} "
                               f"(4 per CPU core); use --processes <= {limit}")
        if isinstance(rollout, bool) or not isinstance(rollout, int):
            raise RLInputError(f"--rollout must be an integer, got {rollout!r}")
        if processes >= 2 and not 1 <= rollout <= processes - 1:
            raise RLInputError(f"--rollout {rollout} leaves a pool of size 0 with {processes} processes: "
                               f"each pool needs >= 1 process, use --rollout 1..{processes - 1}")

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.group

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RLInputError(f"unknown rl setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**d)
