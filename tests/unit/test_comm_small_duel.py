"""Sizes under learn_bytes duel on their own once the exchange won at a learned size (comm/adaptive.py
`_small_arm`, comm/duel.py `due`): planning alone, and on real gloo groups (agreed times, no hang)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.commgroups import groups, on_ranks
from tests.unit.planning import FAST, uniform
from unbroken.comm import adaptive
from unbroken.comm.adaptive import AdaptiveAllreduce, Ran
from unbroken.comm.duel import Duel
from unbroken.comm.patterns import Pattern, reference
from unbroken.comm.planner import paced

MB = 1 << 20
SIZE = 64 * MB  # learned
SMALL = 1 * MB  # under learn_bytes (8 MB)
_seq = itertools.count(900)


@settings(max_examples=40, deadline=None)
@given(every=st.integers(2, 9), first=st.sampled_from(["ring", "exchange"]),
       times=st.lists(st.floats(0.01, 10.0), min_size=2, max_size=40))
def test_due_names_the_first_runs_each_loser_rerun_and_the_winners_run_before_it(every, first, times):
    d = Duel(every=every)
    trials = []
    for i, t in enumerate(times):
        arm, trial = d.pick(SMALL, first=first)
        if i == 0:
            assert arm == first and not trial
        elif i == 1:
            assert arm != first and trial
        trials.append(trial)
        due = d.due(SMALL)
        next_is_trial = i >= 1 and (i + 1 - 1) % every == 0  # picks after both ran: the every-th is the loser
        assert due == (i < 2 or trial or next_is_trial)
        d.ran(SMALL, arm, t)
    with pytest.raises(ValueError, match="arm"):
        d.pick(SMALL, first="tree")


def test_won_by_counts_only_sizes_from_at_least():
    d = Duel()
    d.ran(SMALL, "ring", 2.0)
    d.ran(SMALL, "exchange", 1.0)
    assert d.won_by("exchange") and not d.won_by("exchange", 8 * MB)
    d.ran(SIZE, "ring", 2.0)
    d.ran(SIZE, "exchange", 1.0)
    assert d.won_by("exchange", 8 * MB)


def _planning(events: list, *, exchange_won: bool) -> AdaptiveAllreduce:
    """Planning only: every link read at FAST; at SIZE the duel ran (the exchange won unless not `exchange_won`)."""
    a = uniform(events)
    a.duel.ran(SIZE, "ring", 2.0)
    a.duel.ran(SIZE, "exchange", 1.0 if exchange_won else 2.0)
    return a


def _small_ran(ad: AdaptiveAllreduce, seconds: float) -> None:
    """As if the small plan decided just ran in `seconds` and its time came back in the flow exchange."""
    assert ad._small_due
    ad._ran = Ran(ad.plan, SMALL)
    ad._replan(torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64), seconds, SMALL)


def test_a_small_size_runs_the_ring_when_the_ring_beats_the_exchange_at_that_size():
    """On 8 ranks the exchange won at 16 MB and ran 1 MB at 1.7x the static ring's time (stop 52)."""
    events: list = []
    ad = _planning(events, exchange_won=True)
    ring = paced(Pattern.static_ring(4), SMALL)
    ad.decide(SMALL)
    assert ad.plan == ad._exchange(SMALL) and ad._small_due and not ad._trial  # the learned sizes' winner first
    _small_ran(ad, 0.07)
    assert ad.plan == ring and ad._small_due and ad._trial  # then the ring, as a trial
    _small_ran(ad, 0.04)
    assert ad.plan == ring and not ad._small_due and not ad._trial  # it won at this size: it runs, untimed
    (kind, f), = [e for e in events if e[0] == "collective_plan"]
    assert f["bytes"] == SMALL and f["plan"] == ring.to_json() and f["by_time"] == {"exchange": 0.07, "ring": 0.04}
    assert ad.duel.winner(SIZE) == "exchange"  # the learned size keeps its own winner


def test_a_small_size_keeps_the_exchange_where_it_wins_and_its_time_stays_fresh():
    ad = _planning([], exchange_won=True)
    ad.decide(SMALL)
    _small_ran(ad, 0.03)  # the exchange
    _small_ran(ad, 0.05)  # the ring's trial: slower
    due = []
    for _ in range(2 * ad.duel.every):
        assert ad.plan.kind == "pipelined" or ad._trial
        due.append(ad._small_due)
        if ad._small_due:
            _small_ran(ad, 0.05 if ad._trial else 0.03)
        else:
            ad.decide(SMALL)
    assert sum(due) == 4  # two timed collectives in every DUEL_EVERY: the loser's re-run and the one before


@pytest.mark.parametrize("why", ["no stream", "slow link"])
def test_without_a_stream_at_a_learned_size_or_beside_a_slow_link_small_sizes_do_not_duel_the_ring(why):
    """The uncongested job's small all-reduces cost what they did: no trial of the exchange, no sync.
    Beside a slow link the ring/exchange duel is off; the plan around it duels its depth instead."""
    ad = _planning([], exchange_won=why != "no stream")
    if why == "slow link":
        _slow_rank_one(ad)
    for _ in range(20):
        ad.decide(SMALL)
        if why == "no stream":
            assert not ad._small_due and ad.plan == paced(Pattern.static_ring(4), SMALL)
        else:
            assert ad.plan.kind == "pipelined" and ad.plan.split[1] == 0 and ad._depth_arm is not None
    assert SMALL not in ad.duel.seconds


def _slow_rank_one(ad: AdaptiveAllreduce) -> None:
    for _ in range(3):
        for way in ("up", "down"):
            ad.table.observe((way, 1), FAST / 4)


def _depth_ran(ad: AdaptiveAllreduce, nbytes: int, seconds: float) -> None:
    """As if the plan decided ran in `seconds` and its exchange came back (no flows)."""
    ad._ran = Ran(ad.plan, nbytes, ad._depth_arm)
    ad._replan(torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64), seconds, nbytes)


@pytest.mark.parametrize("nbytes", [SMALL, 4 * MB])
def test_a_plan_around_a_slow_rank_runs_at_the_depth_that_ran_faster(nbytes):
    """On 8 ranks sharing 2 cores, 1 MB around a slow rank ran 1.4x the static ring in one piece and
    1.1x in the model's two (stop 53): the depth is tried, not only modelled."""
    events: list = []
    ad = _planning(events, exchange_won=False)
    _slow_rank_one(ad)
    ad.decide(nbytes)
    model = ad.plan
    assert model.split[1] == 0 and model.pieces >= 2 and ad._depth_arm == "model" and ad._small_due
    _depth_ran(ad, nbytes, 0.05)
    assert ad.plan == dataclasses.replace(model, pieces=model.pieces // 2) and ad._trial and ad._small_due
    _depth_ran(ad, nbytes, 0.04)  # half the pieces: faster
    assert ad.plan.pieces == model.pieces // 2 and not ad._trial and not ad._small_due
    (kind, f), = [e for e in events if e[0] == "collective_plan" and e[1]["bytes"] == nbytes]
    assert f["plan"]["pieces"] == model.pieces // 2 and f["previous"]["pieces"] == model.pieces
    assert f["by_time"] == {"model": 0.05, "half": 0.04} and f["congested"] == ["down:1", "up:1"]
    runs = []
    for _ in range(ad.depth.every):
        runs.append(ad.plan.pieces)
        _depth_ran(ad, nbytes, 0.04) if ad._small_due else ad.decide(nbytes)
    assert runs.count(model.pieces) == 1  # the model's depth once more (a trial), the faster otherwise


def test_a_sizes_first_collective_is_no_duels_evidence():
    """In stop 52's 4-rank record the first round of every slow cell ran 1.05-1.19x static's speed at
    1-16 MB and the others 1.25-1.64x: one such time picked the ring over the split at 1 MB (stop 53)."""
    ad = uniform([])
    ad.decide(SIZE)
    ring = ad.plan
    ad._judge(ring, SIZE, 1.0, cold=True)
    assert SIZE not in ad.duel.seconds
    ad._judge(ring, SIZE, 1.0)
    assert ad.duel.seconds[SIZE] == {"ring": 1.0}


def test_a_collective_the_planner_ran_for_runs_cold():
    """Ranks leave the planner apart, and the fastest waits for the slowest inside the timed collective
    (stop 52's 4-rank record: the first 1 MB split ran 43 ms with 8 ms of planning, then 22-26 ms)."""
    ad = uniform([])
    ad.decide(SIZE)
    assert ad._planned  # a size's first plan: the planner ran
    ad._planned = False
    ad.decide(SIZE)
    assert not ad._planned  # the same picture of the links: the planner's choice remembered


def test_the_depth_duel_starts_afresh_when_the_plan_changes():
    ad = _planning([], exchange_won=False)
    _slow_rank_one(ad)
    ad.decide(SMALL)
    _depth_ran(ad, SMALL, 0.05)
    _depth_ran(ad, SMALL, 0.04)
    assert ad.depth.winner(SMALL) == "half"
    for _ in range(3):  # rank 2 gets slow too: another plan
        for way in ("up", "down"):
            ad.table.observe((way, 2), FAST / 4)
    ad.decide(SMALL)
    assert ad.plan.split[2] == 0 and ad._depth_arm == "model" and ad.depth.winner(SMALL) is None


def test_small_sizes_duel_on_real_groups_with_agreed_times_and_reference_bits():
    """Three ranks (threads) of one gloo group: the small size's timed collectives carry their seconds
    in the flow exchange, every rank runs the same plan at every collective, and every result equals the
    reference reduction bitwise."""
    n = 4096

    def setup(ad: AdaptiveAllreduce) -> None:
        ad.duel = Duel(every=4)
        ad.duel.ran(1 << 30, "ring", 2.0)  # another job's stream: the exchange won at a learned size
        ad.duel.ran(1 << 30, "exchange", 1.0)

    runs = _run_on_groups(steps := 12, n, setup, learn_bytes=1 << 20, seconds_of=lambda ad: ad.duel.seconds[n * 4])
    plans = [h["plan"] for h in runs[0][1]]
    assert plans[0] == plans[1] and plans[0]["kind"] == "pipelined"  # the size's first run is no evidence
    assert plans[2]["kind"] == "ring" and plans[2]["window"] > 0
    waited = [h["sync_s"] is not None for h in runs[0][1]]
    planned = [h["plan_s"] for h in runs[0][1]]  # the planner's part of the wait
    assert [x is not None for x in planned] == waited
    assert all(h["plan_s"] <= h["sync_s"] for h in runs[0][1] if h["sync_s"] is not None)
    assert waited == [i in (1, 2, 3, 6, 7, 10, 11) for i in range(steps)]  # after collectives 0-2, 5, 6, 9, 10
    assert [h["probe"] == "duel" for h in runs[0][1]] == [i in (2, 6, 10) for i in range(steps)]


def test_the_depth_duel_on_real_groups_agrees_and_keeps_the_reference_bits():
    """Three ranks (threads), rank 1 read slow on every rank: the plan around it runs at both depths,
    the same plan at every collective on every rank, results bitwise equal to the reference."""
    n = 1 << 20  # 4 MB: the model cuts it in pieces

    def setup(ad: AdaptiveAllreduce) -> None:
        ad.depth = Duel(arms=ad.depth.arms, every=4)
        for _ in range(3):
            for rr in range(ad.world):
                for way in ("up", "down"):
                    ad.table.observe((way, rr), FAST / 4 if rr == 1 else FAST)

    runs = _run_on_groups(8, n, setup, learn_bytes=1 << 40, seconds_of=lambda ad: ad.depth.seconds.get(n * 4, {}))
    plans = [h["plan"] for h in runs[0][1]]
    assert plans[0]["split"][1] == 0 and plans[1] == plans[0]  # the size's first run is no evidence
    assert plans[2]["pieces"] == plans[0]["pieces"] // 2
    assert set(runs[0][2]) == {"model", "half"}


def _run_on_groups(steps: int, n: int, setup, *, learn_bytes: int, seconds_of, world: int = 3) -> list:
    """`steps` all-reduces of n random float32 on each of `world` ranks (threads, one gloo group), each
    rank's all-reduce prepared by `setup`; asserts every rank ran the same plans, agreed on the duel's
    seconds (`seconds_of`) and got the reference reduction's bits. Per rank: results, history, seconds."""
    g = torch.Generator().manual_seed(n + steps)
    xs = [[torch.randn(n, generator=g) * 1e3 for _ in range(world)] for _ in range(steps)]
    seqs = [next(_seq) for _ in range(steps)]
    want = [on_ranks(world, lambda tp, r, i=i: (reference(tp, t := xs[i][r].clone(), seqs[i]), t)[1])
            for i in range(steps)]

    def body(tp, r):
        ad = AdaptiveAllreduce(groups(world)[r], rank=r, world=world, timeout_s=20, learn_bytes=learn_bytes)
        setup(ad)
        outs = []
        for i in range(steps):
            t = xs[i][r].clone()
            ad(t)
            outs.append(t)
        ad.close()
        return outs, list(ad.history), dict(seconds_of(ad))

    runs = on_ranks(world, body, timeout_s=60)
    plans = [h["plan"] for h in runs[0][1]]
    for r in range(world):
        outs, history, seconds = runs[r]
        assert [h["plan"] for h in history] == plans and seconds == runs[0][2]  # agreed on every rank
        for i in range(steps):
            assert torch.equal(outs[i].view(torch.uint8), want[i][r].view(torch.uint8))
    return runs
