"""The reallocation policy and the pools' accounting (idle fractions, pool sizes, lengths)."""
import math

from unbroken.rl.controller import Controller, Observation
from unbroken.rl.metrics import Timeline, length_stats, time_to_target


def test_lent_time_is_busy_and_counted_apart():
    tl = Timeline()
    tl.set_role(0, 0.0, "train")
    tl.add_busy(0, 0.0, 2.0)
    tl.add_lent(0, 3.0, 5.0)
    assert math.isclose(tl.idle_fraction("train", 0, 10), 1 - 4 / 10)
    assert math.isclose(tl.lent_seconds(0, 10), 2.0) and math.isclose(tl.lent_seconds(4, 10), 1.0)


def obs(step, rollout=2, train=2, rw=1.0, tw=1.0):
    return Observation(step, rollout, train, rw, tw, 0.0, 0.0, 0)


def test_controller_moves_toward_the_balanced_split_with_cooldown():
    c = Controller(gain=0.1, cooldown=2, lending=False)
    m = c.decide(obs(0, rw=3.0, tw=1.0))  # generation is 3x the training work: 3 rollout processes
    assert m.to_pool == "rollout" and "3 rollout processes" in m.reason
    assert c.decide(obs(1, rw=3.0, tw=1.0)) is None  # cooldown
    assert c.decide(obs(2, rw=1.0, tw=3.0)).to_pool == "train"
    assert c.decide(obs(4, rw=1.0, tw=1.0)) is None  # balanced already
    assert c.decide(obs(6, rw=1.05, tw=1.0, rollout=2, train=2)) is None  # a gain under 10%: stay
    assert c.decide(obs(8, rollout=1, train=3, rw=0.01, tw=5.0)) is None  # never empties a pool
    assert c.decide(obs(10, rollout=3, train=1, rw=5.0, tw=0.01)) is None
    assert c.decide(obs(12, rollout=3, train=1, rw=1.0, tw=1.0)).to_pool == "train"


def test_with_lending_only_a_training_bound_step_moves_a_process():
    """Trainers lend a hand to generation, so a rollout-heavy step needs no move; a step whose
    training work exceeds the trainers' share of all work takes a rollout worker."""
    c = Controller(gain=0.1, cooldown=1)
    assert c.decide(obs(0, rw=3.0, tw=1.0)) is None  # 2 trainers: 0.5 s each < 4 s / 4 processes
    m = c.decide(obs(1, rollout=3, train=1, rw=1.0, tw=3.0))  # 1 trainer: 3 s vs (1 + 3) / 4
    assert m.to_pool == "train" and "2 rollout processes" not in m.reason  # 3 s/1 -> best is 1r3t
    assert "1 rollout processes predict 1.000" in m.reason
    assert c.decide(obs(3, rollout=1, train=3, rw=3.0, tw=1.0)) is None  # more trainers than needed: they lend
    m = c.decide(obs(5, rollout=2, train=2, rw=0.2, tw=3.0))  # staleness 1: one rollout process stays
    assert m.to_pool == "train" and m.count == 1 and "1 rollout processes predict 1.000" in m.reason


def test_on_policy_the_phases_add_up_so_lending_trainers_take_most_processes():
    """Staleness 0: generation and training alternate. With lending every process generates, so
    a step is rollout work / N + training work / trainers: more trainers are always better, up to
    every process (time-sharing), and both move in one generation; without lending the sum of the
    two pools' phases is balanced, not their maximum."""
    c = Controller(gain=0.1, cooldown=1, overlap=False)
    m = c.decide(obs(0, rw=3.0, tw=1.0))  # 2 trainers: 3/4 + 1/2; every process: 3/4 + 1/4
    assert m.to_pool == "train" and m.count == 2 and "0 rollout processes predict 1.000 s/step vs 1.250" in m.reason
    assert c.decide(obs(1, rollout=0, train=4, rw=3.0, tw=1.0)) is None  # at the best split already
    m = c.decide(obs(2, rollout=1, train=3, rw=3.0, tw=1.0))  # 3/4 + 1/3 = 1.083 vs 1.0: under 10 %
    assert m is None
    m = c.decide(obs(3, rollout=1, train=3, rw=1.0, tw=3.0))  # 1/4 + 3/3 = 1.25 vs 1/4 + 3/4 = 1.0
    assert m.to_pool == "train" and m.count == 1
    overlapped = Controller(gain=0.1, cooldown=1)  # staleness 1, the same work: trainers lend, no move
    assert overlapped.decide(obs(0, rw=3.0, tw=1.0)) is None
    alone = Controller(gain=0.1, cooldown=1, lending=False, overlap=False)
    # 3/r + 1/(4-r): r=2 gives 2.0, r=3 gives 2.0, r=1 gives 3.33: stay at the even split
    assert alone.decide(obs(0, rw=3.0, tw=1.0)) is None
    assert alone.decide(obs(1, rw=0.5, tw=3.0)).to_pool == "train"  # 0.5 + 1.5 vs 0.5/1 + 1.0


def test_idle_fraction_and_sizes():
    tl = Timeline()
    tl.set_role(0, 0.0, "rollout")
    tl.set_role(1, 0.0, "train")
    tl.add_busy(0, 0.0, 10.0)
    tl.add_busy(1, 2.0, 4.0)
    tl.set_role(1, 5.0, "rollout")  # moved at t=5
    tl.add_busy(1, 5.0, 10.0)
    assert math.isclose(tl.idle_fraction("train", 0, 10), 1 - 2 / 5)
    assert math.isclose(tl.idle_fraction("rollout", 0, 10), 0.0)
    assert tl.idle_fraction("both", 0, 10) is None
    assert tl.sizes(10.0) == [(0.0, 1, 1), (5.0, 2, 0)]


def test_length_stats_and_time_to_target():
    s = length_stats([3] * 90 + [20] * 10)
    assert s["p50"] == 3 and s["p90"] == 20 and s["max"] == 20 and s["histogram"] == {"3": 90, "20": 10}
    curve = [{"t": float(i), "reward": r} for i, r in enumerate([0.1, 0.2, 0.5, 0.5, 0.5])]
    assert time_to_target(curve, 0.4, window=2) == 3.0
    assert time_to_target(curve, 0.9, window=2) is None
