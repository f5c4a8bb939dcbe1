"""The protection interval: K's formula, the gradient ring's memory bound, "auto", bad values."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.config import ConfigError, RunConfig
from unbroken.protect.interval import MAX_K, best_interval, largest_fitting, ring_slots
from unbroken.runtime.autok import IntervalTuner


@settings(max_examples=60, deadline=None)
@given(c=st.floats(1e-4, 1.0), s=st.floats(1e-3, 10.0), r=st.floats(1e-4, 1.0), m=st.floats(1.0, 1e6))
def test_best_interval_minimizes_the_expected_cost(c, s, r, m):
    k = best_interval(parity_s=c, step_s=s, replay_step_s=r, mtbf_s=m, max_k=10**6)

    def cost(x):  # failure-free parity cost per second + expected replay per second
        return c / (x * s) + (x / 2) * r / m

    assert 1 <= k
    assert cost(k) <= min(cost(max(1, k - 1)), cost(k + 1)) * (1 + 1e-9) or k == 1


def test_best_interval_is_capped_and_rejects_nonsense():
    assert best_interval(parity_s=1, step_s=0.1, replay_step_s=0.001, mtbf_s=1e6, max_k=16) == 16
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive finite"):
            best_interval(parity_s=bad, step_s=1, replay_step_s=1, mtbf_s=1)


def test_ring_slots_name_the_largest_k_that_fits():
    assert largest_fitting(100, 1050) == 10
    assert ring_slots(8, 100, 1000) == 8
    assert ring_slots("auto", 100, 10**9) == MAX_K
    assert ring_slots("auto", 100, 550) == 5
    with pytest.raises(ValueError, match="use --protect-every 10 or less"):
        ring_slots(11, 100 << 20, 1000 << 20)
    with pytest.raises(ValueError, match="not even one"):
        ring_slots("auto", 100, 50)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "often", True])
def test_protect_every_must_be_a_positive_integer_or_auto(bad):
    with pytest.raises(ConfigError, match="protect_every must be an integer >= 1 or 'auto'"):
        RunConfig(protect_every=bad)


def test_tuner_waits_for_a_parity_step_then_chooses_from_the_averages():
    t = IntervalTuner(mtbf_s=3600.0, max_k=32)
    aux = torch.zeros(3)
    t.fill(aux)
    assert aux.tolist() == [0, 0, 0] and t.choose(aux) is None and not t.done  # nothing measured yet
    for step in range(1, 8):
        t.observe(step, 0.2, 0.01, parity=False)
    t.observe(8, 0.25, 0.06, parity=True)
    t.fill(aux)
    assert aux.tolist() == pytest.approx([0.2, 0.01, 0.05])
    chosen = t.choose(aux)
    want = best_interval(parity_s=0.05, step_s=0.2, replay_step_s=0.01, mtbf_s=3600.0, max_k=32)
    assert t.done and chosen["protect_every"] == want
