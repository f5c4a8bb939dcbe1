"""A short seeded GRPO run from the brief supervised warm start raises the mean reward."""
import torch

from unbroken.rl import local, policy
from unbroken.rl.config import RLConfig


def test_grpo_raises_mean_reward():
    torch.set_num_threads(1)
    cfg = RLConfig(digits=1, pretrain_steps=100, pretrain_batch=32, steps=40, seed=0)
    curve, _ = local.run_local(cfg, policy.pretrain(cfg))
    first = sum(r["reward"] for r in curve[:10]) / 10
    last = sum(r["reward"] for r in curve[-10:]) / 10
    assert last > first + 0.03, (first, last)
