"""The single-process RL loop: generate every group of a step, then update; the reference the pooled
runs are compared with, and what the reward test runs."""
from __future__ import annotations

import copy

from unbroken.rl import grpo, policy, task
from unbroken.rl.config import RLConfig


def run_local(cfg: RLConfig, init_state: dict, reward=task.default_reward, log=None) -> tuple[list[dict], dict]:
    """cfg.steps GRPO steps on-policy: one {"step", "reward", "tokens", "lengths"} per step, and the
    final weights."""
    model = policy.new_policy(cfg)
    model.load_state_dict(init_state)
    ref = copy.deepcopy(model).eval() if cfg.kl > 0 else None
    opt = grpo.new_optimizer(model, cfg)
    curve = []
    for step in range(cfg.steps):
        prompts = task.step_prompts(cfg.seed, step, cfg.prompts, cfg.digits, cfg.lengths, cfg.max_repeat)
        samples = [s for p in prompts for s in grpo.rollout_group(model, cfg, p, step, step, reward)]
        for _ in range(cfg.epochs):
            grpo.local_update(model, opt, samples, cfg, ref)
        rec = {"step": step, "reward": sum(s.reward for s in samples) / len(samples),
               "tokens": grpo.tokens(samples), "lengths": [len(s.tokens) for s in samples]}
        curve.append(rec)
        if log:
            log(rec)
    return curve, model.state_dict()
