"""Reading links under an uneven plan (comm/adaptive.py `_replan`, `_probe_if_slower`): only the
links the plan was made around take their readings; the plan's time calls an even probe, whose
readings count twice. Planning only: no group."""
from __future__ import annotations

import pytest
import torch

from unbroken.comm import adaptive
from unbroken.comm.adaptive import AdaptiveAllreduce
from unbroken.comm.flows import Flow, FlowConfig, FlowTable
from unbroken.comm.patterns import Pattern
from unbroken.comm.planner import pieces_for

MB = 1 << 20
FAST, SLOW = 125e6, 125e6 / 4
SIZE = 64 * MB


def _slots(world: int, flows: list[tuple[int, int, float]]) -> torch.Tensor:
    """The exchanged slots of one collective whose rows i -> j (bytes 8 MB) took the given seconds."""
    slots = torch.zeros(world, world, adaptive.PHASES, 4, dtype=torch.float64)
    for src, dst, seconds in flows:
        slots[dst, src, 0, :3] = torch.tensor([8 * MB, 100.0, 100.0 + seconds], dtype=torch.float64)
        slots[src, dst, 0, 3] = 100.0
    return slots


def _feed(ad: AdaptiveAllreduce, slow: set[int]) -> None:
    for _ in range(3):
        for r in range(ad.world):
            for way in ("up", "down"):
                ad.table.observe((way, r), SLOW if r in slow else FAST)


def _ran(ad: AdaptiveAllreduce, seconds: float, flows: list[tuple[int, int, float]]) -> None:
    """As if the current plan just ran SIZE in `seconds` (slowest rank) with these row flows."""
    ad._ran = (ad.plan, SIZE)
    ad._replan(_slots(ad.world, flows), seconds, SIZE)


@pytest.fixture
def around_1() -> AdaptiveAllreduce:
    """Four ranks, rank 1's links slow: the plan gives rank 1 no chunk."""
    ad = AdaptiveAllreduce(None, rank=0, world=4, timeout_s=5)
    _feed(ad, {1})
    ad._measured = True
    ad.decide(SIZE)
    assert ad.plan.split[1] == 0 and len(set(ad.plan.split)) > 1
    return ad


def _owners_busy(ad: AdaptiveAllreduce, rank1_s: float) -> list[tuple[int, int, float]]:
    """Rows into the owners 0, 2, 3: every flow at a third of an owner's link (three senders share it),
    rank 1's at `rank1_s` seconds."""
    third = 8 * MB / (FAST / 3)
    return [(i, j, rank1_s if i == 1 else third) for j in (0, 2, 3) for i in range(4) if i != j]


def test_fast_links_read_low_at_busy_owners_keep_their_estimates(around_1):
    before = {k: v.rate for k, v in around_1.table.links.items()}
    for _ in range(3):
        _ran(around_1, 1.0, _owners_busy(around_1, 8 * MB / SLOW))
    for r in (0, 2, 3):  # each read a third of its rate (its flows' sum at its owners' fair share)
        assert around_1.table.rate(("up", r)) == before[("up", r)]
    assert ("up", 1) in around_1.slow_links()[0]  # its rows ran slower than the others into the owners
    assert around_1.plan.split[1] == 0  # still around rank 1 alone


def test_the_link_a_plan_was_made_around_takes_its_readings_and_clears(around_1):
    for _ in range(2):  # rank 1 recovered: its rows arrive as fast as the others'
        _ran(around_1, 1.0, _owners_busy(around_1, 8 * MB / (FAST / 3)))
    assert around_1.table.rate(("up", 1)) == pytest.approx(FAST)  # two readings of three
    assert ("up", 1) not in around_1.slow_links()[0]
    for _ in range(4):  # rank 1 receives no rows: its down link is forgotten (stale_after), then cleared
        _ran(around_1, 1.0, _owners_busy(around_1, 8 * MB / (FAST / 3)))
    assert around_1.plan.window  # nothing left to plan around: the paced ring


def test_an_uneven_plan_running_slower_than_its_best_calls_an_even_probe_read_twice(around_1):
    plan = around_1.plan
    _ran(around_1, 1.0, _owners_busy(around_1, 8 * MB / SLOW))
    assert around_1.plan == plan
    _ran(around_1, 1.05, _owners_busy(around_1, 8 * MB / SLOW))  # within PROBE_SLOWER of its best
    assert around_1.plan == plan
    _ran(around_1, 1.3, _owners_busy(around_1, 8 * MB / SLOW))  # rank 3's link got slow, unseen
    assert around_1.plan == Pattern.static_ring(4, pieces_for(SIZE)) and around_1._probe == "slower"
    cap = {0: FAST, 1: SLOW, 2: FAST, 3: SLOW}  # each link shared by three flows
    even = [(i, j, 8 * MB / (min(cap[i], cap[j]) / 3)) for i in range(4) for j in range(4) if i != j]
    _ran(around_1, 1.5, even)  # the probe: one reading, counted twice, flags rank 3 at once
    assert {("up", 3), ("down", 3)} <= set(around_1.slow_links()[0])
    assert around_1.plan.split[3] == 0 and around_1._probe is None


def test_a_reading_of_weight_two_moves_the_median_of_three_at_once():
    t = FlowTable(FlowConfig())
    for _ in range(3):
        t.observe(("up", 0), FAST)
    t.observe_flows([Flow(0, 1, 16 * MB, 0.0, 16 * MB / SLOW)], judge=lambda link, rate: (rate, 2))
    assert t.rate(("up", 0)) == pytest.approx(SLOW)


def test_links_a_reading_is_refused_keep_their_estimate_and_do_not_go_stale():
    t = FlowTable(FlowConfig(stale_after=2))
    t.observe(("up", 0), FAST)
    t.observe(("down", 1), FAST)
    for _ in range(3):
        t.observe_flows([Flow(0, 1, 16 * MB, 0.0, 16 * MB / SLOW)],
                        judge=lambda link, rate: (rate, 1) if link == ("down", 1) else (None, 0))
    assert t.rate(("up", 0)) == FAST and t.rate(("down", 1)) == pytest.approx(SLOW)


def test_a_weight_below_one_is_refused():
    with pytest.raises(ValueError, match="weight"):
        FlowTable().observe(("up", 0), FAST, weight=0)
