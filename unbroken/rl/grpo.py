"""GRPO: a group of samples per prompt, rewards normalized within the group into advantages, and the
clipped-ratio policy-gradient loss (optional KL to the reference policy). The loss of any share of a
step's samples is normalized by the whole step's token count, so summing the trainers' gradients
gives the same update however the samples are split between them."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from unbroken.rl import policy, task
from unbroken.rl.config import RLConfig

GRAD_CLIP = 1.0


@dataclass
class Sample:
    step: int            # the training step this sample belongs to
    index: int           # its prompt's position in the step (the group)
    prompt: str
    tokens: list[int]    # the completion, EOS included when produced
    old_logp: list[float]  # the sampling policy's log-probability of each token
    reward: float
    advantage: float
    version: int         # the weights version (updates applied) that sampled it


def group_seed(seed: int, step: int, index: int) -> int:
    """The sampling RNG of one group: the same whichever process generates it."""
    return random.Random(f"rl-sample/{seed}/{step}/{index}").getrandbits(62)


def group_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [0.0 if std < 1e-8 else (r - mean) / (std + 1e-4) for r in rewards]


def rollout_group(model, cfg: RLConfig, prompt: task.Prompt, step: int, version: int, reward) -> list[Sample]:
    """cfg.group completions of one prompt, scored by `reward` and given group-normalized advantages."""
    gen = torch.Generator().manual_seed(group_seed(cfg.seed, step, prompt.index))
    outs = policy.sample(model, [prompt.text] * cfg.group, task.max_new_tokens(cfg.digits, cfg.max_repeat),
                         cfg.temperature, gen)
    rewards = [task.score(reward, prompt.text, task.decode(toks)) for toks, _ in outs]
    return [Sample(step, prompt.index, prompt.text, toks, lps, r, a, version)
            for (toks, lps), r, a in zip(outs, rewards, group_advantages(rewards))]


def loss(model, samples: list[Sample], cfg: RLConfig, normalizer: float, ref=None) -> torch.Tensor:
    """Clipped surrogate (and k3 KL to `ref` when cfg.kl > 0), summed over tokens / normalizer."""
    prompts, comps = [s.prompt for s in samples], [s.tokens for s in samples]
    logp, mask = policy.token_logprobs(model, prompts, comps, cfg.temperature)
    old = torch.zeros_like(logp)
    for i, s in enumerate(samples):
        old[i, :len(s.old_logp)] = torch.tensor(s.old_logp)
    adv = torch.tensor([s.advantage for s in samples])[:, None]
    ratio = torch.exp((logp - old) * mask)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
    total = -(surr * mask).sum()
    if cfg.kl > 0 and ref is not None:
        with torch.no_grad():
            ref_lp, _ = policy.token_logprobs(ref, prompts, comps, cfg.temperature)
        d = (ref_lp - logp) * mask
        total = total + cfg.kl * ((torch.exp(d) - d - 1) * mask).sum()
    return total / normalizer


def tokens(samples: list[Sample]) -> int:
    return sum(len(s.tokens) for s in samples)


def local_update(model, opt, samples: list[Sample], cfg: RLConfig, ref=None) -> float:
    """One optimizer step on all of a step's samples in this process (the single-process reference)."""
    opt.zero_grad(set_to_none=True)
    out = loss(model, samples, cfg, float(tokens(samples)), ref)
    out.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    return float(out.detach())


def new_optimizer(model, cfg: RLConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.lr)
