"""The duel of the paced ring and the direct exchange by time (comm/duel.py), alone and inside the
adaptive all-reduce's planning (comm/adaptive.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.planning import uniform
from unbroken.comm import adaptive
from unbroken.comm.adaptive import AdaptiveAllreduce, Ran
from unbroken.comm.duel import DUEL_EVERY, DUEL_MARGIN, Duel
from unbroken.comm.patterns import Pattern
from unbroken.comm.planner import paced

MB = 1 << 20
FAST = 125e6
SIZE = 64 * MB
times = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(ring=times, exchange=times, every=st.integers(2, 12), later=st.lists(times, max_size=40))
def test_the_ring_runs_first_then_the_exchange_then_the_faster_and_every_nth_the_other(ring, exchange, every, later):
    d = Duel(every=every)
    assert d.pick(SIZE) == ("ring", False)
    d.ran(SIZE, "ring", ring)
    assert d.pick(SIZE) == ("exchange", True)
    d.ran(SIZE, "exchange", exchange)
    since = 0
    for t in later:
        won = "exchange" if d.seconds[SIZE]["exchange"] * DUEL_MARGIN < d.seconds[SIZE]["ring"] else "ring"
        assert d.winner(SIZE) == won and d.won_by("exchange") == (won == "exchange")
        arm, trial = d.pick(SIZE)
        since += 1
        if since == every:  # the loser, once
            since = 0
            assert trial and arm != won
        else:
            assert not trial and arm == won
        d.ran(SIZE, arm, t)


def test_the_exchange_wins_only_by_the_margin_and_each_size_has_its_own_duel():
    d = Duel()
    d.ran(SIZE, "ring", 1.0)
    d.ran(SIZE, "exchange", 1.0 / DUEL_MARGIN + 1e-6)  # faster, but not by the margin
    assert d.winner(SIZE) == "ring" and not d.won_by("exchange")
    assert d.winner(2 * SIZE) is None and d.pick(2 * SIZE) == ("ring", False)
    d.ran(SIZE, "exchange", 0.9)
    assert d.winner(SIZE) == "exchange" and d.won_by("exchange")


@pytest.mark.parametrize("kw, names", [({"every": 1}, "every"), ({"margin": 0.9}, "margin")])
def test_a_bad_duel_setting_names_itself(kw, names):
    with pytest.raises(ValueError, match=names):
        Duel(**kw)
    with pytest.raises(ValueError, match="arm"):
        Duel().ran(SIZE, "tree", 1.0)


def _fresh(events: list) -> AdaptiveAllreduce:
    """Planning only (no group): every link read at FAST, nothing duelled yet."""
    a = uniform(events)
    a.decide(SIZE)
    return a


def _ran(ad: AdaptiveAllreduce, seconds: float) -> None:
    """As if the plan decided just ran in `seconds` (slowest rank) and its exchange came back, no flows."""
    ad._ran = Ran(ad.plan, SIZE)
    ad._replan(torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64), seconds, SIZE)


def test_another_jobs_stream_the_links_do_not_show_makes_the_exchange_run_once_it_beat_the_ring():
    events: list = []
    ad = _fresh(events)
    ring = paced(Pattern.static_ring(4), SIZE)
    assert ad.plan == ring
    _ran(ad, 1.6)  # the ring's one flow on the shared link gets half of it
    assert ad.plan == ad._exchange(SIZE) and ad._trial  # the trial
    _ran(ad, 1.2)
    assert ad.plan == ad._exchange(SIZE) and not ad._trial  # it won: it runs
    (kind, f), = [e for e in events if e[0] == "collective_plan"]
    assert f["plan"]["kind"] == "pipelined" and f["previous"] == ring.to_json()
    assert f["by_time"] == {"ring": 1.6, "exchange": 1.2}
    for _ in range(DUEL_EVERY - 2):
        _ran(ad, 1.2)
        assert ad.plan == ad._exchange(SIZE)
    _ran(ad, 1.2)
    assert ad.plan == ring and ad._trial  # the ring again, once: has the stream stopped?
    _ran(ad, 0.9)  # it has
    assert ad.plan == ring and not ad._trial
    assert [e[1]["plan"]["kind"] for e in events if e[0] == "collective_plan"] == ["pipelined", "ring"]
    assert not [e for e in events if e[0] == "collective_plan_rejected"]  # the duel judges, not _judge


def test_with_no_stream_the_ring_stays_after_its_trial_and_nothing_is_an_event():
    events: list = []
    ad = _fresh(events)
    _ran(ad, 1.0)
    _ran(ad, 1.02)  # the exchange's trial: no faster
    for _ in range(5):
        assert ad.plan == paced(Pattern.static_ring(4), SIZE)
        _ran(ad, 1.0)
    assert not events


def test_links_read_shared_are_planned_around_only_once_the_exchange_won_by_time():
    """On 8 ranks sharing 2 cores healthy links read shared: such readings alone changed no plan."""
    for ring_s, exchange_s in ((1.0, 1.0), (1.6, 1.2)):
        ad = _fresh([])
        for _ in range(3):
            for way in ("up", "down"):
                ad.table.observe((way, 2), 0.7 * FAST)
        _ran(ad, ring_s)  # the paced ring
        assert ad.plan == ad._exchange(SIZE)  # the duel's trial, not a split around rank 2
        _ran(ad, exchange_s)
        if ring_s == exchange_s:  # no stream: the readings alone changed nothing
            assert ad.plan == paced(Pattern.static_ring(4), SIZE)
        else:  # the exchange won: planned around rank 2's links
            assert ad.plan.kind == "pipelined" and ad.plan.split[2] < ad.plan.split[0]
    small = ad.learn_bytes // 2  # never judged, never duelled: it follows the learned sizes
    ad.decide(small)
    assert ad.plan.kind == "pipelined" and ad.plan.split[2] < ad.plan.split[0]


def test_a_split_around_shared_links_slower_than_the_even_exchange_is_rejected():
    """Judged against the faster of the duel's arms: on 8 ranks splits made from misread links ran
    1.1-1.3x the even exchange's time while still beating the ring."""
    events: list = []
    ad = _fresh(events)
    _ran(ad, 1.6)
    _ran(ad, 1.0)  # the even exchange won
    for rank in (2, 1):  # the split around rank 2, then re-made around rank 1
        for _ in range(3):
            for r in range(4):
                for way in ("up", "down"):
                    ad.table.observe((way, r), (0.7 if r == rank else 1.0) * FAST)
        _ran(ad, 1.0 if rank == 2 else 1.2)
        assert ad.plan.kind == "pipelined" and ad.plan.split[rank] < ad.plan.split[0]
    _ran(ad, 1.2)  # faster than the ring (1.6), slower than the even exchange twice: rejected
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["previous_seconds"] == 1.0
    assert ad.plan == ad._exchange(SIZE)  # nothing planned around: the duel's winner


def test_a_link_that_gets_slow_starts_the_duel_afresh():
    """The paced ring that called the probe ran at the slow hop's pace: against it the exchange of
    before would win, and keep running once the link is fast again."""
    ad = _fresh([])
    _ran(ad, 1.0)
    _ran(ad, 1.1)  # the ring won
    for _ in range(3):
        for way in ("up", "down"):
            ad.table.observe((way, 1), FAST / 4)
    _ran(ad, 2.5)  # a paced ring at the slow hop's pace; its probe's readings (here fed) flag rank 1
    assert ad.plan.split[1] == 0 and ad.duel.seconds == {}
    ad.plan = paced(Pattern.static_ring(4), SIZE)  # a paced ring beside the slow link (a new size's first)
    _ran(ad, 2.5)
    assert ad.duel.seconds == {}  # beside a slow link the duel learns nothing
    assert Duel().pick(SIZE) == ad.duel.pick(SIZE) == ("ring", False)


def test_a_split_at_a_size_whose_duel_was_forgotten_is_judged_against_the_paced_ring():
    ad = _fresh([])
    ad._ring_s[SIZE] = 1.0  # a paced ring ran at SIZE before a slow link made the duel start afresh
    ad._last[SIZE] = (Pattern(kind="pipelined", order=(0, 1, 2, 3), split=(1, 0, 1, 1), pieces=4), 2.0)
    split = Pattern(kind="pipelined", order=(0, 1, 2, 3), split=(3, 3, 1, 3), pieces=4)
    ad._judge(split, SIZE, 1.2)
    assert ad._judged[SIZE] == 1.0  # slower than the ring once: its next run decides
