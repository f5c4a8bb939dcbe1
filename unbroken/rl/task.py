"""The verifiable task: d-digit addition whose answer is repeated k times ("07+35x2=" -> "42,42;"),
its token vocabulary, the prompts of a step (a function of seed and step), and the reward checks.

k is heavy-tailed in "longtail" mode (most prompts want one answer, a few want many), so completion
lengths are long-tailed; "uniform" mode always asks for k=1.
"""
from __future__ import annotations

import importlib
import math
import random
from dataclasses import dataclass
from typing import Callable

from unbroken.rl.errors import RLInputError

ALPHABET = "_0123456789+=x,;"  # '_' pads, ';' ends a completion
PAD, EOS = 0, ALPHABET.index(";")
VOCAB = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
TAIL = 0.4  # longtail: P(k) proportional to TAIL**(k-1)

Reward = Callable[[str, str], float]


@dataclass(frozen=True)
class Prompt:
    text: str     # what the policy sees, e.g. "07+35x2="
    answer: str   # the correct completion, without the EOS, e.g. "42,42"
    index: int    # position in its step's batch (the group id)


def encode(text: str) -> list[int]:
    return [_INDEX[c] for c in text]


def decode(ids: list[int]) -> str:
    return "".join(ALPHABET[i] for i in ids)


def prompt_len(digits: int) -> int:
    return 2 * digits + 4


def max_new_tokens(digits: int, max_repeat: int) -> int:
    """The sampling cap: the longest correct answer plus two tokens of slack."""
    return max_repeat * (digits + 2) + 2


def _repeat(rng: random.Random, lengths: str, max_repeat: int) -> int:
    if lengths == "uniform":
        return 1
    weights = [TAIL ** (k - 1) for k in range(1, max_repeat + 1)]
    return rng.choices(range(1, max_repeat + 1), weights)[0]


def make_prompt(rng: random.Random, digits: int, lengths: str, max_repeat: int, index: int = 0) -> Prompt:
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    k = _repeat(rng, lengths, max_repeat)
    return Prompt(f"{a:0{digits}d}+{b:0{digits}d}x{k}=", ",".join([str(a + b)] * k), index)


def step_prompts(seed: int, step: int, n: int, digits: int, lengths: str, max_repeat: int) -> list[Prompt]:
    """Step `step`'s prompts: the same in every process and every method (a function of seed and step)."""
    rng = random.Random(f"rl-prompts/{seed}/{step}")
    return [make_prompt(rng, digits, lengths, max_repeat, i) for i in range(n)]


def requested_tokens(p: Prompt) -> int:
    """The completion length the prompt asks for (k answers of up to digits + 1 characters, each
    followed by ',' or the EOS), read from the prompt alone: the coordinator hands out the longest
    groups first, so the step's long tail starts early instead of last."""
    left, k = p.text[:-1].split("x")
    return int(k) * (len(left.split("+")[0]) + 2)


def default_reward(prompt: str, completion: str) -> float:
    """0.7 x the fraction of the k requested answers that are right (extra answers count against)
    + 0.3 when the completion has exactly k answers and ends with the EOS."""
    left, k = prompt[:-1].split("x")
    a, b = left.split("+")
    want, k = str(int(a) + int(b)), int(k)
    ended = completion.endswith(";")
    parts = completion[:-1].split(",") if ended else completion.split(",")
    right = sum(p == want for p in parts[:k])
    return 0.7 * right / max(k, len(parts)) + 0.3 * (ended and len(parts) == k)


def load_reward(spec: str | None) -> Reward:
    """None: the default; "package.module:function": a user's fn(prompt, completion) -> number."""
    if spec is None:
        return default_reward
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise RLInputError(f"--reward {spec!r} must look like package.module:function")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise RLInputError(f"--reward {spec!r}: cannot load it ({e}); give an importable module:function") from None
    if not callable(fn):
        raise RLInputError(f"--reward {spec!r} is not callable; give a function fn(prompt, completion) -> number")
    return fn


def score(reward: Reward, prompt: str, completion: str) -> float:
    """reward(prompt, completion) checked: it must return a finite number, and must not raise."""
    try:
        r = reward(prompt, completion)
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported the same way
        raise RLInputError(f"the reward function raised {type(e).__name__}: {e} (on prompt {prompt!r}, "
                           f"completion {completion!r}); fix it to return a number for every completion") from None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise RLInputError(f"the reward function returned {r!r} for prompt {prompt!r}: it must return a finite "
                           "number (int or float)")
    return float(r)
