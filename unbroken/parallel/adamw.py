"""AdamW as an elementwise update of one chunk, given the step's fixed global scalars.

Elementwise means a chunk's new bytes depend only on its old bytes, its gradient slice
and the scalars, so a chunk can be (re)applied in isolation during recovery and give
exactly the bytes a failure-free run gives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from unbroken.protect.txn import StepScalars


@dataclass(frozen=True, kw_only=True)
class AdamW:
    lr: float
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 5
    total_steps: int = 100

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% at total_steps."""
        if step <= self.warmup_steps:
            return self.lr * step / max(1, self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def scalars(self, step: int, grad_norm: float, loss: float = 0.0) -> StepScalars:
        """Global scalars from the norm of the full (replicated, averaged) gradient. A non-finite
        norm or loss reaches here only when the step is to be skipped (runtime's on_nonfinite)."""
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            return StepScalars(step=step, lr=self.lr_at(step), clip_coef=0.0, skip=True)
        clip = 1.0 if self.grad_clip <= 0 else min(1.0, self.grad_clip / (grad_norm + 1e-6))
        return StepScalars(step=step, lr=self.lr_at(step), clip_coef=clip)

    def apply(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: StepScalars,
              point: Callable[[], None] | None = None) -> None:
        """Update p, m, v in place; `point` is a fault-injection hook half-way through.

        The clip coefficient is folded into the moment updates' scalars (no scaled copy of
        the gradient); the denominator is torch's: sqrt(v) / sqrt(bc2) + eps."""
        if s.skip:
            return
        c = s.clip_coef
        p.mul_(1.0 - s.lr * self.weight_decay)
        m.mul_(self.beta1).add_(g, alpha=(1.0 - self.beta1) * c)
        if point is not None:
            point()
        v.mul_(self.beta2).addcmul_(g, g, value=(1.0 - self.beta2) * c * c)
        bc1 = 1.0 - self.beta1 ** s.step
        bc2 = 1.0 - self.beta2 ** s.step
        denom = torch.sqrt(v).div_(math.sqrt(bc2)).add_(self.eps)
        p.addcdiv_(m, denom, value=-s.lr / bc1)
