"""The built-in job's training recipe: torch's AdamW (β2 0.95), linear warm-up then cosine decay, clip 1.0.

It is chosen explicitly by the built-in job (and by the benchmarks' native peers, so both
train the same thing); unbroken never substitutes it for a user's optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unbroken.config import RunConfig


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    lr: float
    warmup_steps: int = 5
    total_steps: int = 100

    def factor(self, step: int) -> float:
        """Linear warm-up to 1, then cosine decay to 0.1 at total_steps (step counts from 1)."""
        if step <= self.warmup_steps:
            return step / max(1, self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    def lr_at(self, step: int) -> float:
        return self.lr * self.factor(step)


def default_training(model: torch.nn.Module, cfg: RunConfig):
    """(optimizer, scheduler, grad_clip) of the built-in job, from the run config."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    shape = WarmupCosine(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    # LambdaLR's epoch e is the number of steps done: step e + 1 uses factor(e + 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: shape.factor(e + 1))
    return opt, sched, (cfg.grad_clip if cfg.grad_clip > 0 else None)
