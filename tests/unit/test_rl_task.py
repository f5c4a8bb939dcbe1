"""The RL task: prompts are a function of (seed, step), the reward checks the sum and the repeat
count, and a reward function that raises or returns a non-number is a one-line input error."""
import math

import pytest
import torch

from unbroken.rl import grpo, policy, task
from unbroken.rl.config import RLConfig
from unbroken.rl.errors import RLInputError


def test_prompts_are_a_function_of_seed_and_step():
    a = task.step_prompts(3, 5, 16, 2, "longtail", 6)
    assert a == task.step_prompts(3, 5, 16, 2, "longtail", 6)
    assert a != task.step_prompts(3, 6, 16, 2, "longtail", 6)
    assert all(len(p.text) == task.prompt_len(2) for p in a)
    uni = task.step_prompts(3, 5, 64, 2, "uniform", 6)
    assert {p.text[-2] for p in uni} == {"1"}


def test_longtail_lengths_are_heavy_tailed():
    ks = [int(p.text[-2]) for p in task.step_prompts(0, 0, 2000, 2, "longtail", 6)]
    assert ks.count(1) > 0.5 * len(ks) and 0 < ks.count(6) < 0.03 * len(ks)


def test_requested_tokens_bounds_the_right_completion_and_orders_prompts_by_k():
    """Read from the prompt alone: the right completion's length when each sum has a carry digit,
    an upper bound otherwise; more answers asked for, more tokens."""
    ps = task.step_prompts(1, 2, 200, 3, "longtail", 6)
    for p in ps:
        right, total = len(p.answer) + 1, int(p.answer.split(",")[0])
        assert right <= task.requested_tokens(p)
        assert (right == task.requested_tokens(p)) == (len(str(total)) == 4)
    by_k = sorted(ps, key=lambda p: -task.requested_tokens(p))
    assert [int(p.text[-2]) for p in by_k] == sorted((int(p.text[-2]) for p in ps), reverse=True)


@pytest.mark.parametrize("completion,want", [("42,42;", 1.0), ("42;", 0.35), ("41,42;", 0.65),
                                             ("42,42,42;", 0.7 * 2 / 3), ("42,42", 0.7), ("", 0.0)])
def test_default_reward(completion, want):
    assert math.isclose(task.default_reward("07+35x2=", completion), want)


def test_reward_that_raises_or_returns_non_number_is_an_input_error():
    def boom(p, c):
        raise KeyError("x")

    with pytest.raises(RLInputError, match="raised KeyError"):
        task.score(boom, "1+2x1=", "3;")
    for bad in ("1.0", None, float("nan"), True):
        with pytest.raises(RLInputError, match="finite number"):
            task.score(lambda p, c, v=bad: v, "1+2x1=", "3;")
    with pytest.raises(RLInputError, match="module:function"):
        task.load_reward("nocolon")
    assert task.load_reward("unbroken.rl.task:default_reward") is task.default_reward


@pytest.mark.parametrize("kw,match", [({"processes": 4, "rollout": 0}, "pool of size 0"),
                                      ({"processes": 4, "rollout": 4}, "pool of size 0"),
                                      ({"processes": 10_000}, "machine's limit"),
                                      ({"staleness": 2}, "staleness"), ({"lengths": "long"}, "lengths")])
def test_bad_config(kw, match):
    with pytest.raises(RLInputError, match=match):
        RLConfig(**kw)


def test_kv_cache_decoding_matches_the_full_forward():
    cfg = RLConfig(n_layer=2, n_head=2, n_embd=32)
    model = policy.new_policy(cfg).eval()
    idx = torch.randint(0, task.VOCAB, (3, 14))
    with torch.no_grad():
        full = model(idx)[:, 7:]
    assert torch.allclose(policy.cached_logits(model, idx, 8), full, atol=1e-5)


def test_sampling_stops_at_eos_and_logprobs_match_training():
    cfg = RLConfig(digits=1, n_embd=32)
    model = policy.new_policy(cfg).eval()
    ps = [p.text for p in task.step_prompts(0, 0, 6, 1, "longtail", 6)]
    cap = task.max_new_tokens(1, 6)
    outs = policy.sample(model, ps, cap, 1.0, torch.Generator().manual_seed(1))
    for toks, lps in outs:
        assert len(toks) == len(lps) and 1 <= len(toks) <= cap
        assert task.EOS not in toks[:-1] and (toks[-1] == task.EOS or len(toks) == cap)
    with torch.no_grad():
        lp, mask = policy.token_logprobs(model, ps, [t for t, _ in outs], 1.0)
    for i, (toks, lps) in enumerate(outs):
        assert torch.allclose(lp[i, :len(toks)], torch.tensor(lps), atol=1e-4)
    again = policy.sample(model, ps, cap, 1.0, torch.Generator().manual_seed(1))
    assert [t for t, _ in again] == [t for t, _ in outs]


def test_group_advantages_are_normalized():
    a = grpo.group_advantages([0.0, 1.0, 1.0, 0.0])
    assert math.isclose(sum(a), 0.0, abs_tol=1e-9) and all(math.isclose(abs(x), 1.0, rel_tol=1e-3) for x in a)
    assert grpo.group_advantages([0.5] * 4) == [0.0] * 4


def test_kl_term_is_zero_against_itself_and_positive_against_another_policy():
    cfg = RLConfig(digits=1, n_embd=32, kl=0.5)
    model = policy.new_policy(cfg)
    other = policy.new_policy(RLConfig(digits=1, n_embd=32, seed=1))
    p = task.step_prompts(0, 0, 1, 1, "longtail", 6)[0]
    samples = grpo.rollout_group(model, cfg, p, 0, 0, task.default_reward)
    n = float(grpo.tokens(samples))
    plain = grpo.loss(model, samples, RLConfig(digits=1, n_embd=32), n)
    assert torch.allclose(grpo.loss(model, samples, cfg, n, ref=model), plain, atol=1e-6)
    assert float(grpo.loss(model, samples, cfg, n, ref=other).detach()) > float(plain.detach()) + 1e-4
