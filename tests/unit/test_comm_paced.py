"""The paced ring in the adaptive all-reduce (comm/adaptive.py): its flows are not read, its time is,
and a slow one makes the next collective run unpaced and measure the links."""
from __future__ import annotations

import pytest
import torch

from tests.unit.commgroups import groups, on_ranks
from unbroken.comm import adaptive
from unbroken.comm.adaptive import AdaptiveAllreduce, Ran
from unbroken.comm.duel import Duel
from unbroken.comm.flows import FlowConfig
from unbroken.comm.patterns import Pattern
from unbroken.comm.planner import PACED_WINDOW, paced, pieces_for

MB = 1 << 20
FAST = 125e6
SIZE = 64 * MB


def _uniform(ad: AdaptiveAllreduce) -> None:
    for _ in range(3):
        for r in range(ad.world):
            for way in ("up", "down"):
                ad.table.observe((way, r), FAST)


def _after_paced(ad: AdaptiveAllreduce, seconds: float) -> None:
    """As if a paced ring of SIZE just ran in `seconds` (slowest rank) and its exchange came back."""
    ad._ran = Ran(ad.plan, SIZE)
    slots = torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64)
    ad._replan(slots, seconds, SIZE)


def _planning(events: list | None = None, *, exchange_won: bool = True) -> AdaptiveAllreduce:
    """Planning only (no group): every link read at FAST, the paced ring planned; events into `events`.
    The duel (comm/duel.py) decided: at SIZE the ring won (the tests below are about the ring and the
    plans around flagged links); at another size the exchange won unless not `exchange_won` (shared
    links are planned around only then); its losing arm never runs again here."""
    a = AdaptiveAllreduce(None, rank=0, world=4, timeout_s=5,  # planning only: no group
                          emit=None if events is None else lambda kind, **f: events.append((kind, f)))
    a.duel = Duel(every=1 << 30)
    for size, ring, exchange in ((SIZE, 100.0, 1000.0), (3 * SIZE, 2.0, 1.0))[: 1 + exchange_won]:
        a.duel.ran(size, "ring", ring)
        a.duel.ran(size, "exchange", exchange)
    _uniform(a)
    a._measured = True
    a.decide(SIZE)
    assert a.plan == paced(Pattern.static_ring(4), SIZE)
    return a


@pytest.fixture
def ad() -> AdaptiveAllreduce:
    return _planning()


def test_a_paced_rings_flows_are_not_read_and_its_usual_time_keeps_it(ad):
    ticks = ad.table.tick
    for s in (1.00, 0.97, 1.05, 1.06):  # within PROBE_SLOWER (1.1x) of the fastest so far
        _after_paced(ad, s)
        assert ad.plan.window == PACED_WINDOW
    assert ad.table.tick == ticks  # nothing folded into the link estimates


def test_a_paced_ring_slower_than_its_best_makes_the_next_one_measure(ad):
    _after_paced(ad, 1.0)
    _after_paced(ad, 1.15)  # a link got slow, or another job's stream shares one
    assert ad.plan == Pattern.static_ring(4, pieces_for(SIZE))  # unpaced, the ring's own pieces
    assert ad.plan.window == 0


def test_a_paced_ring_slower_than_an_earlier_plan_of_its_size_makes_the_next_one_measure(ad):
    """The first paced ring of a size ran while another job's stream shared a link: the plan before
    it (here a probe's unpaced ring) was faster, and that is the yardstick, not the paced ring itself."""
    ad._ran = Ran(Pattern.static_ring(4, pieces_for(SIZE)), SIZE)
    ad._replan(torch.zeros(4, 4, adaptive.PHASES, 4, dtype=torch.float64), 1.0, SIZE)
    assert ad.plan.window == PACED_WINDOW
    _after_paced(ad, 1.5)
    assert ad.plan.window == 0


def _probe_ran(ad: AdaptiveAllreduce, cap: dict[int, float], seconds: float = 1.0) -> None:
    """As if the probe (the even ring, unpaced) just ran in `seconds` with each rank's links at `cap`
    bytes/s, every link shared by its three row flows."""
    ad._ran = Ran(ad.plan, SIZE)
    slots = torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64)
    for i in range(ad.world):
        for j in range(ad.world):
            if i != j:
                slots[j, i, 0, :3] = torch.tensor([8 * MB, 100.0, 100.0 + 8 * MB / (min(cap[i], cap[j]) / 3)],
                                                  dtype=torch.float64)
                slots[i, j, 0, 3] = 100.0
    ad._replan(slots, seconds, SIZE)


def test_a_probe_called_by_a_slower_ring_counts_its_readings_twice(ad):
    _after_paced(ad, 1.0)
    _after_paced(ad, 1.3)  # rank 1's link got slow
    assert ad.plan.window == 0 and ad._probe == "slower"
    _probe_ran(ad, {0: FAST, 1: FAST / 4, 2: FAST, 3: FAST})  # one reading, counted twice: slow at once
    assert {("up", 1), ("down", 1)} <= set(ad.slow_links()[0])
    assert ad.plan.split[1] == 0 and ad._probe is None


def test_a_routine_probe_counts_its_readings_once(ad):
    for _ in range(adaptive.PROBE_EVERY):
        ad.decide(SIZE)
        _after_paced(ad, 1.0)
    assert ad.plan.window == 0 and ad._probe == "every"
    _probe_ran(ad, {0: FAST, 1: FAST / 4, 2: FAST, 3: FAST})  # one low reading of three: noise, so far
    assert ad.slow_links()[0] == {} and ad.plan.window == PACED_WINDOW


def test_a_routine_probe_that_ran_slower_itself_counts_its_readings_twice(ad):
    for _ in range(adaptive.PROBE_EVERY):
        ad.decide(SIZE)
        _after_paced(ad, 1.0)
    assert ad._probe == "every"
    _probe_ran(ad, {0: FAST, 1: FAST / 4, 2: FAST, 3: FAST}, seconds=2.0)  # the link got slow meanwhile
    assert {("up", 1), ("down", 1)} <= set(ad.slow_links()[0]) and ad.plan.split[1] == 0


def test_every_eighth_paced_ring_measures_even_when_nothing_changed(ad):
    probes = []
    for i in range(2 * adaptive.PROBE_EVERY):
        ad.decide(SIZE)
        _after_paced(ad, 1.0)
        probes.append(ad.plan.window == 0)
    assert [i + 1 for i, p in enumerate(probes) if p] == [adaptive.PROBE_EVERY, 2 * adaptive.PROBE_EVERY]


def test_the_first_learned_collective_runs_unpaced_then_the_ring_is_paced(monkeypatch):
    # a shared CI machine can make one paced ring 10% slower than the one before, which rightly
    # makes the next one probe (tested above on planning alone); here only the order is checked
    monkeypatch.setattr(adaptive, "PROBE_SLOWER", float("inf"))
    world, n = 3, (8 * MB) // 4

    def body(tp, r):
        # flows on loopback threads say nothing about links: none is read (min_bytes), so noise
        # cannot flag a link and the uniform plan stays
        a = AdaptiveAllreduce(groups(world)[r], rank=r, world=world, timeout_s=20,
                              flow_cfg=FlowConfig(min_bytes=1 << 40))
        for _ in range(3):
            a(torch.ones(n))
        a.sync.finish()
        small = AdaptiveAllreduce(groups(world)[r], rank=r, world=world, timeout_s=20)
        small(torch.ones(n // 2))  # 4 MB: too small to learn from, so no probe: the paced ring as decided
        return [(h["plan"]["kind"], h["plan"]["window"], h["probe"]) for h in a.history], \
            small.history[-1]["plan"]["window"]

    for runs, small in on_ranks(world, body, timeout_s=60):
        # the probe, the paced ring, then the duel's trial of the direct exchange (comm/duel.py)
        assert runs == [("ring", 0, "first"), ("ring", PACED_WINDOW, None), ("pipelined", 0, "duel")]
        assert small == PACED_WINDOW


def test_with_nothing_to_plan_around_the_ring_is_paced_where_the_model_scores_the_exchange_faster():
    """On 8 ranks with no reading yet (every link at the stand-in rate of 1 GB/s) the model scores the
    direct exchange faster at 16 MB; it puts N-1 of our flows on every link: the paced ring runs."""
    a = AdaptiveAllreduce(None, rank=0, world=8, timeout_s=5)
    a.decide(16 * MB)
    assert a.plan.kind == "ring" and a.plan.window == PACED_WINDOW and a.plan.split == (1,) * 8


def _read_shared(ad: AdaptiveAllreduce, shared: int = 2) -> None:
    """Readings of every link, rank `shared`'s at 0.7x the others' (another job's stream, or noise)."""
    for _ in range(3):
        for r in range(ad.world):
            for way in ("up", "down"):
                ad.table.observe((way, r), (0.7 if r == shared else 1.0) * FAST)


def _read_slow(ad: AdaptiveAllreduce, ranks: tuple[int, ...]) -> None:
    """Three readings of every link, those of `ranks` at a quarter of the others' rate."""
    for _ in range(3):
        for r in range(ad.world):
            for way in ("up", "down"):
                ad.table.observe((way, r), FAST / 4 if r in ranks else FAST)


def _ran(ad: AdaptiveAllreduce, plan: Pattern, seconds: float) -> None:
    """As if `plan` of SIZE just ran in `seconds` and its exchange came back (no flows in it)."""
    ad._ran = Ran(plan, SIZE)
    ad._replan(torch.zeros(ad.world, ad.world, adaptive.PHASES, 4, dtype=torch.float64), seconds, SIZE)


def _shared_probe(ad: AdaptiveAllreduce, seconds: float) -> None:
    """As if the probe (the even ring, unpaced) ran in `seconds` and read rank 2's links shared; before
    it the paced ring, the first time at SIZE (a plan around flagged links runs only after it)."""
    if SIZE not in ad._ring_s:
        _after_paced(ad, seconds)
    _read_shared(ad)
    _ran(ad, Pattern.static_ring(4, pieces_for(SIZE)), seconds)


def _uneven_ran(ad: AdaptiveAllreduce, seconds: float) -> None:
    """As if the plan made around rank 2's links ran in `seconds`."""
    assert ad.plan.kind == "pipelined" and ad.plan.split[2] < ad.plan.split[0]
    _read_shared(ad)
    _ran(ad, ad.plan, seconds)


@pytest.fixture
def events() -> list[tuple[str, dict]]:
    return []


def test_a_plan_around_flagged_links_that_loses_to_the_even_ring_is_rejected(events):
    ad = _planning(events)
    _shared_probe(ad, 1.0)
    assert ad.contended(FAST) == [("down", 2), ("up", 2)] and ad.plan.kind == "pipelined"
    _uneven_ran(ad, 1.2)  # the split exchange ran slower than the even ring it was made from: once, noise maybe
    assert ad.plan.kind == "pipelined" and not [e for e in events if e[0] == "collective_plan_rejected"]
    _uneven_ran(ad, 1.15)  # twice: rejected
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["seconds"] == 1.15 and f["previous_seconds"] == 1.0 and f["contended"] == ["down:2", "up:2"]
    for _ in range(adaptive.VETO_FOR - 1):  # the same readings again: still not planned around
        _read_shared(ad)
        _ran(ad, ad.plan, 1.0)  # paced rings, and every eighth a probe
        assert ad.plan.kind == "ring" and ad.plan.split == (1,) * 4
    _read_shared(ad)
    _ran(ad, ad.plan, 1.0)  # the rejection ran out: planned around again
    assert ad.plan.kind == "pipelined"


def test_a_paced_ring_slower_when_a_rejection_runs_out_makes_the_next_one_measure(events):
    """The rejection of a plan around a shared link runs out at the very collective after which a link
    got slow: the picture of the shared link is older than the slowdown, so the next collective is the
    probe (unpaced even ring, readings counted twice), not the plan around that picture (stop 56: on 8
    ranks such a plan ran, and the slow link stayed unflagged for the whole congestion)."""
    ad = _planning(events)
    _shared_probe(ad, 1.0)
    _uneven_ran(ad, 1.2)
    _uneven_ran(ad, 1.15)  # rejected: paced rings for VETO_FOR learned collectives
    while ad._learned < ad._vetoed_until - 1:
        _read_shared(ad)
        _ran(ad, ad.plan, 1.0)
    if not ad.plan.window:  # a routine probe was due: one more paced ring before the last
        _ran(ad, ad.plan, 1.0)
    assert ad.plan.window == PACED_WINDOW and ad._learned == ad._vetoed_until - 1
    _ran(ad, ad.plan, 1.5)  # the last vetoed collective, and a link got slow during it
    assert ad.plan == Pattern.static_ring(4, pieces_for(SIZE)) and ad._probe == "slower"
    assert ad._depth_arm is None and not ad._trial


def test_a_plan_around_flagged_links_runs_after_the_paced_ring_of_its_size(events):
    """The first probe, unpaced and cold, is no yardstick: the plan waits for the paced ring it must beat."""
    ad = _planning(events)
    _read_shared(ad)
    _ran(ad, Pattern.static_ring(4, pieces_for(SIZE)), 2.0)  # the job's first collective, a probe: slow
    assert ad.contended(FAST) == [("down", 2), ("up", 2)]
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)  # not the plan around rank 2 yet
    _read_shared(ad)
    _ran(ad, ad.plan, 1.0)
    assert ad.plan.kind == "pipelined"
    _uneven_ran(ad, 1.2)
    _uneven_ran(ad, 1.2)  # slower than the paced ring twice (faster than the probe): rejected
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["previous_seconds"] == 1.0


def test_a_size_not_learned_from_takes_a_plan_around_slow_links_once_it_passed_at_a_learned_size():
    """Small sizes are never judged (their times are not shared): they wait for the judgment of a
    learned size's plan around the same links."""
    ad = _planning(exchange_won=False)
    small = ad.learn_bytes // 2
    _after_paced(ad, 1.0)
    _read_slow(ad, (1,))
    ad.decide(small)
    assert ad.plan == paced(Pattern.static_ring(4), small)  # the plan around rank 1 has not run yet
    ad.decide(SIZE)
    assert ad.plan.split[1] < max(ad.plan.split)
    _ran(ad, ad.plan, 1.2)  # slower than the ring once: not judged yet
    ad.decide(small)
    assert ad.plan == paced(Pattern.static_ring(4), small)
    ad.decide(SIZE)
    _ran(ad, ad.plan, 0.95)  # its second run beat the ring: passed
    ad.decide(small)
    assert ad.plan.window == 0 and ad.plan.split[1] < max(ad.plan.split)
    ad.decide(SIZE * 2)  # a learned size the paced ring never ran at: the ring first
    assert ad.plan == paced(Pattern.static_ring(4), SIZE * 2)


def test_a_plan_around_flagged_links_that_beats_the_even_ring_stays(ad):
    _shared_probe(ad, 1.0)
    _uneven_ran(ad, 0.8)
    _uneven_ran(ad, 1.3)  # judged once, against the ring it replaced: later times are the links'
    assert ad.plan.kind == "pipelined" and ad._vetoed_until == 0


def test_one_slow_run_of_a_plan_around_flagged_links_does_not_reject_it(ad):
    _shared_probe(ad, 1.0)
    _uneven_ran(ad, 1.2)
    _uneven_ran(ad, 0.9)
    _uneven_ran(ad, 1.3)  # judged no more: its times are the links' now
    assert ad.plan.kind == "pipelined" and ad._vetoed_until == 0


def test_a_slower_paced_ring_lifts_a_rejection(ad):
    _shared_probe(ad, 1.0)
    _uneven_ran(ad, 1.2)
    _uneven_ran(ad, 1.2)
    _after_paced(ad, 0.9)
    assert ad._vetoed_until > ad._learned and ad.plan.window == PACED_WINDOW
    _after_paced(ad, 1.1)  # over PROBE_SLOWER x the best (0.9): the links changed
    assert ad._vetoed_until == 0 and ad.plan.window == 0 and ad._probe == "slower"


def test_a_plan_re_made_between_its_two_judged_runs_inherits_the_judgment(events):
    """Readings that move at every collective re-make the split after its first slow run: the new
    split's run is the judgment's second (before, the judgment was dropped and splits followed splits)."""
    ad = _planning(events)
    _shared_probe(ad, 1.0)
    _uneven_ran(ad, 1.2)  # the plan around rank 2 lost to the paced ring once
    around_2 = ad.plan
    _read_shared(ad, shared=1)
    ad.decide(SIZE)  # re-made around rank 1 before its second run
    assert ad.plan.kind == "pipelined" and ad.plan.split[1] < ad.plan.split[0] and ad.plan != around_2
    _ran(ad, ad.plan, 1.15)  # the re-made plan's run loses too: rejected
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["seconds"] == 1.15 and f["previous_seconds"] == 1.0


def test_a_plan_that_follows_another_uneven_plan_is_not_judged(events):
    """Under a shared link the split wobbles between plans that all beat the ring: a trial that judged
    each against the plan before fell back to the slower paced ring."""
    ad = _planning(events)
    _shared_probe(ad, 1.2)
    _uneven_ran(ad, 1.0)  # the plan around rank 2: faster than the probe, kept
    around_2 = ad.plan
    _read_shared(ad, shared=1)
    _ran(ad, ad.plan, 1.0)  # its second run reads rank 1's links shared instead
    assert ad.plan.kind == "pipelined" and ad.plan.split[1] < ad.plan.split[0] and ad.plan != around_2
    _ran(ad, ad.plan, 1.3)
    assert ad.plan.kind == "pipelined" and not [e for e in events if e[0] == "collective_plan_rejected"]


def test_a_plan_re_made_around_other_shared_links_is_judged_against_the_paced_ring(events):
    """On 8 ranks sharing 2 cores the shared links read change at every collective: once one split
    passed, splits followed splits at 1.1-1.3x the paced ring's time, never judged (stop 48)."""
    ad = _planning(events)
    _shared_probe(ad, 1.0)  # the paced ring of SIZE ran in 1.0 s
    _uneven_ran(ad, 0.9)  # the plan around rank 2 beat it: passed
    _read_shared(ad, shared=1)
    _ran(ad, ad.plan, 0.9)  # its next run reads rank 1's links shared instead: re-made
    assert ad.plan.kind == "pipelined" and ad.plan.split[1] < ad.plan.split[0]
    _read_shared(ad, shared=1)
    _ran(ad, ad.plan, 1.2)  # the new split loses to the paced ring once: not yet
    assert ad.plan.kind == "pipelined" and not [e for e in events if e[0] == "collective_plan_rejected"]
    _read_shared(ad, shared=1)
    _ran(ad, ad.plan, 1.2)  # twice: rejected
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["previous_seconds"] == 1.0 and f["contended"] == ["down:1", "up:1"]


def _planned_around_rank_1(events: list) -> AdaptiveAllreduce:
    """The paced ring ran, rank 1's link got slow, a slower ring called a probe that read it: the plan
    now spares rank 1."""
    ad = _planning(events)
    _after_paced(ad, 1.0)
    _after_paced(ad, 1.3)
    _probe_ran(ad, {0: FAST, 1: FAST / 4, 2: FAST, 3: FAST}, seconds=1.3)
    assert ad.plan.split[1] == 0
    return ad


def test_a_plan_re_made_around_slow_links_is_not_judged_against_the_ring_before_they_got_slow(events):
    """The paced ring ran before the link got slow; any plan around it now is slower than that."""
    ad = _planned_around_rank_1(events)
    first = ad.plan
    _read_slow(ad, (1, 2))  # rank 2's link got slow too
    _ran(ad, ad.plan, 1.3)  # re-made around ranks 1 and 2
    assert ad.plan != first and ad.plan.split[2] < ad.plan.split[0]
    _ran(ad, ad.plan, 1.6)
    _ran(ad, ad.plan, 1.6)  # slower than the paced ring of before, twice: no judgment
    assert ad.plan.split[2] < ad.plan.split[0] and ad.plan.window == 0 and ad._vetoed_until == 0
    assert not [e for e in events if e[0] == "collective_plan_rejected"]


def test_once_the_slow_links_clear_links_read_slow_under_the_plan_around_them_are_not_planned_around(events):
    ad = _planned_around_rank_1(events)
    _read_slow(ad, (3,))  # rank 1's link recovered; under the plan around it rank 3's links read slow
    _ran(ad, ad.plan, 0.5)
    assert ad.plan == paced(Pattern.static_ring(4), SIZE)
    (kind, f), = [e for e in events if e[0] == "collective_plan_rejected"]
    assert f["why"] == "its slow links cleared"
    _after_paced(ad, 0.5)
    # still not planned around: the duel, begun afresh when rank 1 got slow, tries the even exchange
    assert ad.plan == ad._exchange(SIZE) and ad._trial
