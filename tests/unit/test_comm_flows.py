"""Flow statistics: moving estimates, peaks of concurrent flows, congestion with hysteresis (comm/flows.py)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.comm.flows import Flow, FlowConfig, FlowTable, LinkEstimate, fleet_rate, join, peak_rates

rates = st.floats(1e3, 1e11, allow_nan=False)


@given(xs=st.lists(rates, min_size=1, max_size=40))
def test_the_estimate_stays_within_the_observations(xs):
    est = LinkEstimate(FlowConfig())
    for x in xs:
        est.observe(x)
    assert min(xs[-3:]) * (1 - 1e-9) <= est.rate <= max(xs[-3:]) * (1 + 1e-9)
    assert est.baseline >= est.rate and est.samples == len(xs)


@given(base=rates, drop=st.floats(0.01, 0.5), steps=st.integers(1, 10))
def test_a_drop_sets_congestion_within_two_observations_and_recovery_clears_it(base, drop, steps):
    cfg = FlowConfig()
    est = LinkEstimate(cfg)
    for _ in range(steps):
        est.observe(base)
    assert not est.congested
    flips = [est.observe(base * drop) for _ in range(2)]
    assert est.congested and sum(flips) == 1  # one change, no flapping
    flips = [est.observe(base) for _ in range(2)]
    assert not est.congested and sum(flips) == 1


@given(base=rates, steps=st.integers(2, 10))
def test_one_outlier_does_not_move_the_estimate(base, steps):
    est = LinkEstimate(FlowConfig())
    for i in range(steps + 2):
        est.observe(base / 10 if i == steps else base)
        assert est.rate == base and not est.congested


@given(base=rates, level=st.floats(0.61, 0.8))
def test_hysteresis_keeps_the_flag_between_the_thresholds(base, level):
    """Between congested_below and clear_above the flag keeps whatever it was."""
    cfg = FlowConfig(window=1)
    est = LinkEstimate(cfg)
    est.observe(base)
    est.observe(base * level)
    assert not est.congested  # above congested_below: never set
    est.observe(base * 0.1)
    assert est.congested
    est.observe(base * level)
    assert est.congested  # not above clear_above: still set
    est.observe(base * 0.9)
    assert not est.congested


@given(spans=st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 5), st.integers(1 << 20, 1 << 26)),
                      min_size=1, max_size=12))
def test_the_peak_is_at_least_each_flow_and_at_most_their_sum(spans):
    flows = [Flow(0, 1, n, s, s + d) for s, d, n in spans]
    peak = peak_rates(flows, FlowConfig())
    each = [n / d for _, d, n in spans]
    for link in (("up", 0), ("down", 1)):
        assert max(each) * (1 - 1e-9) <= peak[link] <= sum(each) * (1 + 1e-9)


def test_disjoint_flows_do_not_add_and_overlapping_ones_do():
    cfg = FlowConfig()
    mb = 1 << 20
    one_after_other = [Flow(0, 1, mb, 0.0, 1.0), Flow(2, 1, mb, 1.0, 2.0)]
    at_once = [Flow(0, 1, mb, 0.0, 1.0), Flow(2, 1, mb, 0.0, 1.0)]
    assert peak_rates(one_after_other, cfg)[("down", 1)] == pytest.approx(mb)
    assert peak_rates(at_once, cfg)[("down", 1)] == pytest.approx(2 * mb)
    assert peak_rates(at_once, cfg)[("up", 0)] == pytest.approx(mb)


def test_small_or_instant_flows_are_not_rates():
    cfg = FlowConfig()
    assert peak_rates([Flow(0, 1, 100 << 10, 0.0, 1.0), Flow(0, 1, 1 << 20, 1.0, 1.0)], cfg) == {}


def test_join_starts_a_flow_when_both_ends_posted():
    flows = join([(0, 1, 7, 1 << 20, 5.0, 9.0), (2, 1, 7, 1 << 20, 5.0, 9.0)], [(0, 1, 7, 6.0)])
    assert flows[0].start == 6.0 and flows[1].start == 5.0  # rank 2's send post unknown: its own


def test_table_reports_flag_changes_per_link():
    t = FlowTable(FlowConfig(window=1))
    fast = [Flow(0, 1, 1 << 24, 0.0, 0.1), Flow(1, 0, 1 << 24, 0.0, 0.1)]
    assert t.observe_flows(fast) == []
    slow = [Flow(0, 1, 1 << 24, 0.0, 1.0), Flow(1, 0, 1 << 24, 0.0, 0.1)]
    assert t.observe_flows(slow) == [(("down", 1), True), (("up", 0), True)]
    assert t.congested() == [("down", 1), ("up", 0)]


@pytest.mark.parametrize("kw", [dict(window=0), dict(congested_below=0.9, clear_above=0.8), dict(min_bytes=-1),
                                dict(contended_below=0.9, uncontended_above=0.9)])
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        FlowConfig(**kw)


def test_a_link_without_flows_is_forgotten_and_its_congestion_cleared():
    t = FlowTable(FlowConfig(window=1, stale_after=2))
    both = [Flow(0, 1, 1 << 24, 0.0, 0.1), Flow(2, 1, 1 << 24, 0.0, 0.1)]
    t.observe_flows(both)
    t.observe_flows([Flow(0, 1, 1 << 24, 0.0, 0.1), Flow(2, 1, 1 << 24, 0.0, 1.0)])
    assert ("up", 2) in t.congested()
    t.observe_flows([Flow(0, 1, 1 << 24, 0.0, 0.1)])  # rank 2 spared: not measured
    assert t.rate(("up", 2)) is not None
    assert t.observe_flows([Flow(0, 1, 1 << 24, 0.0, 0.1)]) == [(("up", 2), False)]
    assert t.rate(("up", 2)) is None and t.rate(("up", 0)) is not None


@given(fast=st.lists(st.floats(80e6, 160e6), min_size=2, max_size=16), data=st.data())
def test_the_fleet_rate_is_the_fast_groups_when_up_to_half_the_links_are_congested(fast, data):
    """Slow links at most 0.4x the slowest fast one, no more of them than fast ones: the reference
    lies among the fast links (the median of all fell between the groups with half of them slow)."""
    slow = data.draw(st.lists(st.floats(1e6, 0.4 * min(fast)), max_size=len(fast)))
    ref = fleet_rate(data.draw(st.permutations(fast + slow)), 0.6)
    assert min(fast) <= ref <= max(fast)


@given(base=st.floats(1e6, 1e10), steps=st.lists(st.floats(1.0, 1.6), min_size=0, max_size=15))
def test_without_a_congestions_gap_the_fleet_rate_is_the_median(base, steps):
    xs, x = [base], base
    for k in steps:  # consecutive rates within 1.6x: no gap of 1 / 0.6
        x *= k
        xs.append(x)
    srt = sorted(xs)
    n = len(srt)
    median = srt[n // 2] if n % 2 else (srt[n // 2 - 1] + srt[n // 2]) / 2
    assert fleet_rate(reversed(xs), 0.6) == pytest.approx(median)


def test_one_inflated_link_is_no_fleet():
    assert fleet_rate([100e6] * 7 + [170e6], 0.6) == 100e6
    with pytest.raises(ValueError, match="at least one"):
        fleet_rate([], 0.6)


def test_a_reading_of_weight_two_moves_the_median_of_three_at_once():
    t = FlowTable(FlowConfig())
    for _ in range(3):
        t.observe(("up", 0), 125e6)
    t.observe_flows([Flow(0, 1, 16 << 20, 0.0, 16 / 31.25)], weight=2)
    assert t.rate(("up", 0)) == pytest.approx((16 << 20) / (16 / 31.25))
    with pytest.raises(ValueError, match="weight"):
        t.observe(("up", 0), 125e6, weight=0)
