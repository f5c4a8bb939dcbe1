"""The chaos schedule generator: valid specs, reproducible, the parity-group rule, full coverage."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.bench.chaos_schedule import (CHAOS_KINDS, LETHAL, MAX_CHUNK, PATTERNS, PRE_COMMIT, SHADOW_STEP,
                                           ChaosShape, schedule, schedules)
from unbroken.runtime.faults import FaultSpec


@st.composite
def shapes(draw) -> ChaosShape:
    world = draw(st.sampled_from([2, 4, 6, 8]))
    group = draw(st.sampled_from([g for g in range(2, world + 1) if world % g == 0]))
    return ChaosShape(world_size=world, steps=draw(st.integers(4, 40)), parity_group=group,
                      protect_every=draw(st.integers(1, 10)), checkpoint_every=draw(st.integers(0, 5)))


SEEDS = st.integers(0, 2**40)


def _check_fault(f: FaultSpec, shape: ChaosShape) -> None:
    assert FaultSpec.parse(str(f)) == f  # what `unbroken run --inject` will read back
    assert f.kind in CHAOS_KINDS and 0 <= f.rank < shape.world_size
    if f.phase == "shadow":
        assert f.step == SHADOW_STEP
    else:
        assert 2 <= f.step <= shape.steps - 1
    assert f.phase != "parity" or f.step == shape.protect_every
    assert f.phase != "checkpoint" or (shape.checkpoint_every and f.step % shape.checkpoint_every == 0)
    assert 0 <= f.chunk < MAX_CHUNK


def _check_pattern(s, shape: ChaosShape) -> None:
    first, *rest = s.faults
    if s.pattern == "single":
        assert rest == []
        return
    (second,) = rest
    lethal_pair = first.kind in LETHAL and second.kind in LETHAL
    if s.pattern.startswith("adjacent"):
        assert second.step == first.step + 1
        assert (second.rank == first.rank) == (s.pattern == "adjacent_same_rank")
        assert second.phase != "parity"
    elif s.pattern in ("same_step", "during_recovery"):  # one incident: the parity-group rule applies
        assert second.step == first.step and second.rank != first.rank
        assert not lethal_pair or shape.group_of(first.rank) != shape.group_of(second.rank)
        if s.pattern == "during_recovery":
            assert first.kind != "nan" and first.phase in PRE_COMMIT and second.phase == "recovery"
    else:
        assert s.pattern == "shadow_startup"
        assert first.kind in LETHAL and second.phase == "shadow" and second.rank == first.rank


@settings(max_examples=60)
@given(seed=SEEDS, shape=shapes())
def test_every_schedule_is_valid(seed, shape):
    for s in schedules(seed, 30, shape):
        assert s.pattern in PATTERNS and 1 <= len(s.faults) <= 2
        for f in s.faults:
            _check_fault(f, shape)
        _check_pattern(s, shape)


@settings(max_examples=40)
@given(seed=SEEDS, index=st.integers(0, 10_000), shape=shapes())
def test_a_schedule_depends_on_seed_and_index_only(seed, index, shape):
    assert schedule(seed, index, shape) == schedule(seed, index, shape)
    assert schedules(seed, 5, shape) == [schedule(seed, i, shape) for i in range(5)]
    # drawing others first (a longer run, another seed) does not change it
    schedules(seed + 1, 7, shape)
    assert schedule(seed, index, shape).specs == schedule(seed, index, shape).specs


def test_seeds_give_different_schedules():
    shape = ChaosShape(world_size=4, steps=12, parity_group=2, protect_every=4, checkpoint_every=2)
    assert [s.specs for s in schedules(0, 20, shape)] != [s.specs for s in schedules(1, 20, shape)]


@settings(max_examples=20)
@given(seed=SEEDS, shape=shapes())
def test_two_hundred_schedules_hold_every_pattern_kind_and_phase(seed, shape):
    got = schedules(seed, 200, shape)
    assert {s.pattern for s in got} == set(PATTERNS)
    faults = [f for s in got for f in s.faults]
    assert {f.kind for f in faults} == set(CHAOS_KINDS)
    phases = {f.phase for f in faults}
    assert set(PRE_COMMIT) | {"recovery", "shadow"} <= phases
    # both orders of a lethal + non-lethal pair, and lethal pairs, occur in one incident
    pairs = {(s.faults[0].kind in LETHAL, s.faults[1].kind in LETHAL) for s in got if s.pattern == "same_step"}
    assert pairs == {(True, True), (True, False), (False, True), (False, False)} or shape.world_size == shape.parity_group


def test_one_parity_group_never_loses_two_members_in_one_incident():
    # world 2, group 2: a same-step or during-recovery partner of a lethal fault must live on
    shape = ChaosShape(world_size=2, steps=12, parity_group=2, protect_every=4, checkpoint_every=2)
    for s in schedules(3, 300, shape):
        if s.pattern in ("same_step", "during_recovery") and s.faults[0].kind in LETHAL:
            assert s.faults[1].kind not in LETHAL


@pytest.mark.parametrize("bad, match", [
    (dict(world_size=1), "world-size >= 2"),
    (dict(steps=3), "steps >= 4"),
    (dict(parity_group=3), "parity-group"),
    (dict(parity_group=1), "parity-group"),
    (dict(protect_every=0), "protect_every"),
])
def test_shapes_that_cannot_hold_the_patterns_are_refused(bad, match):
    args = dict(world_size=4, steps=12, parity_group=2, protect_every=4, checkpoint_every=2) | bad
    with pytest.raises(ValueError, match=match):
        ChaosShape(**args)


@settings(max_examples=100, deadline=None)
@given(seed=SEEDS, nnodes=st.sampled_from([2, 4]))
def test_across_nodes_a_node_loss_never_takes_node_0_and_comes_alone_or_with_a_harmless_fault(seed, nnodes):
    shape = ChaosShape(world_size=8, steps=12, parity_group=2, protect_every=4, checkpoint_every=2, nnodes=nnodes)
    assert "node_loss" in shape.patterns
    seen = set()
    for s in schedules(seed, 2 * len(shape.patterns), shape):
        seen.add(s.pattern)
        if s.pattern != "node_loss":
            continue
        first, *rest = s.faults
        assert first.kind in ("nodekill", "nodestop") and shape.node_of(first.rank) > 0
        assert all(f.kind in ("nan", "linkdrop") and shape.node_of(f.rank) == 0 for f in rest)
    assert seen == set(shape.patterns)


def test_a_one_node_job_never_draws_a_node_loss():
    shape = ChaosShape(world_size=4, steps=12, parity_group=2, protect_every=4, checkpoint_every=2)
    assert all(s.pattern != "node_loss" for s in schedules(0, 50, shape))
