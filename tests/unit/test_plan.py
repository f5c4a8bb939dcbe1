"""The planner's pure parts: topology files, collective times, the two-queue pipeline, the cost and memory model."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from unbroken.plan import cost
from unbroken.plan.pipeline import Pipeline
from unbroken.plan.profile import ModelProfile, Unit, parse_model
from unbroken.plan.topology import Topology, TopologyError, loopback_formula
from unbroken.config import ConfigError


def _profile(**kw) -> ModelProfile:
    units = (Unit(name="blocks.0", params=40_000, flop_share=0.45), Unit(name="blocks.1", params=40_000, flop_share=0.45),
             Unit(name="root", params=20_000, flop_share=0.10))
    base = dict(model={"n_layer": 2}, batch_size=8, ranks_per_host=4, threads=1, params=100_000, units=units,
                forward_s=0.02, backward_s=0.04, optimizer_s=0.01, activation_bytes=1_000_000,
                tensor_elems=(10_000, 10_000, 40_000, 40_000),
                solo_step_s={"ddp": 0.08, "zero1": 0.09, "zero2": 0.1, "zero3": 0.11})
    return ModelProfile(**{**base, **kw})


def _swept(world: int, per_byte: float, base: float = 1e-3) -> Topology:
    sizes = [1024 * 4 ** i for i in range(8)]
    sweeps = {c: [[n, base + per_byte * n * f] for n in sizes]
              for c, f in (("all_reduce", 2.0), ("reduce_scatter", 1.0), ("all_gather", 1.0), ("broadcast", 1.5))}
    t = loopback_formula(world)
    return Topology(world=world, latency_s=t.latency_s, bandwidth_Bps=t.bandwidth_Bps, sweeps=sweeps, label="test")


def test_topology_round_trips_and_interpolates(tmp_path):
    topo = _swept(4, 1e-8)
    path = topo.save(tmp_path / "t.json")
    back = Topology.load(path)
    assert back.sweeps == topo.sweeps and back.world == 4
    assert back.seconds("all_reduce", 1024) == pytest.approx(1e-3 + 2e-8 * 1024)
    mid = 3 * 1024  # between two measured sizes: on the line through them
    assert back.seconds("all_gather", mid) == pytest.approx(1e-3 + 1e-8 * mid)
    big = 1024 * 4 ** 9  # past the largest: the last segment extended
    assert back.seconds("all_gather", big) == pytest.approx(1e-3 + 1e-8 * big)
    assert back.seconds("all_gather", 10) == pytest.approx(1e-3 + 1e-8 * 1024)  # below: latency bound


def test_topology_formula_follows_the_ring_formulas():
    t = loopback_formula(4, alpha_s=1e-4, bandwidth_Bps=1e8)
    n = 1e6
    ar = 2 * 3 * 1e-4 + 2 * 3 / 4 * n / 1e8
    assert t.seconds("all_reduce", n) == pytest.approx(ar)
    assert t.seconds("reduce_scatter", n) == pytest.approx(ar / 2)
    assert loopback_formula(1).seconds("all_reduce", n) == 0.0


@pytest.mark.parametrize("doc, needle", [
    ({"format": "other"}, "is not a unbroken-topology/1 file"),
    ({"format": "unbroken-topology/1", "world": 2, "latency_s": [[0.0]], "bandwidth_Bps": [[0, 1], [1, 0]]}, "2x2"),
    ({"format": "unbroken-topology/1", "world": 2, "latency_s": [[0, 1], [1, 0]], "bandwidth_Bps": [[0, 0], [1, 0]]},
     "must be > 0"),
    ({"format": "unbroken-topology/1", "world": 1, "latency_s": [[0]], "bandwidth_Bps": [[0]],
      "sweeps": {"all_reduce": [[2, 1.0], [1, 2.0]]}}, "sizes must increase"),
])
def test_bad_topology_files_say_why(tmp_path, doc, needle):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TopologyError, match=needle) as e:
        Topology.load(path)
    assert "measure it again" in str(e.value)


def test_missing_and_garbled_topology_files(tmp_path):
    with pytest.raises(TopologyError, match="no topology file"):
        Topology.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TopologyError, match="not a readable JSON"):
        Topology.load(tmp_path / "bad.json")


durations = st.lists(st.tuples(st.sampled_from(["compute", "comm"]), st.floats(0, 1)), min_size=1, max_size=12)


@given(durations, st.data())
@settings(max_examples=60, deadline=None)
def test_pipeline_bounds(tasks, data):
    """The makespan is at least each queue's busy time and the longest chain, at most the sum."""
    pipe = Pipeline()
    for i, (res, sec) in enumerate(tasks):
        after = data.draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True)) if i else []
        pipe.add(f"t{i}", res, sec, after=after)
    span = pipe.makespan()
    total = sum(s for _, s in tasks)
    assert span <= total + 1e-9
    assert span >= max(pipe.busy("compute"), pipe.busy("comm")) - 1e-9


def test_pipeline_overlaps_independent_queues_and_serialises_chains():
    pipe = Pipeline()
    a = pipe.add("backward", "compute", 1.0)
    pipe.add("all-reduce", "comm", 0.5, after=[a])
    pipe.add("more backward", "compute", 1.0)
    assert pipe.makespan() == pytest.approx(2.0)  # the all-reduce hid under the second backward
    with pytest.raises(ValueError, match="not added yet"):
        pipe.add("x", "comm", 1.0, after=[7])


def test_ddp_buckets_follow_torch_ddp():
    assert cost.ddp_buckets((10, 20)) == [120]
    big = (1 << 18,) * 3  # 1 MiB each: the first bucket closes at 1 MiB
    assert cost.ddp_buckets(big) == [1 << 20, 2 << 20]


@given(st.floats(1e-10, 1e-6), st.integers(2, 16))
@settings(max_examples=40, deadline=None)
def test_slower_links_never_predict_faster_steps(per_byte, world):
    prof = _profile()
    fast, slow = _swept(world, per_byte), _swept(world, per_byte * 4)
    for s in cost.STRATEGIES:
        assert cost.predict(s, prof, slow).step_s >= cost.predict(s, prof, fast).step_s - 1e-12


def test_memory_model_is_the_fp32_adam_formulas():
    prof = _profile()
    P, n = 4 * prof.params, 4
    states = {s: cost.memory(s, prof, n)[0] for s in cost.STRATEGIES}
    assert states == {"ddp": 4 * P, "zero1": 2 * P + 2 * P // n, "zero2": P + 3 * P // n, "zero3": 4 * P // n}
    assert states["ddp"] > states["zero1"] > states["zero2"] > states["zero3"]


def test_unbroken_zero3_reduce_scatters_once_after_backward_and_holds_the_local_gradient():
    from unbroken.plan.command import RUNNABLE

    prof, topo = _profile(), _swept(4, 1e-7)
    P, n = 4 * prof.params, 4
    assert cost.memory("zero3", prof, n, schedule="unbroken")[0] == P + 4 * P // n
    ours, fsdp = cost.predict("zero3", prof, topo, schedule="unbroken"), cost.predict("zero3", prof, topo)
    # the same bytes reduce-scattered, in one piece instead of one per unit (no overlap with backward)
    assert ours.comm_s == pytest.approx(fsdp.comm_s - sum(topo.seconds("reduce_scatter", 4 * u.params)
                                                          for u in prof.units)
                                        + topo.seconds("reduce_scatter", 4 * prof.params))
    assert ours.exposed_comm_s > fsdp.exposed_comm_s
    assert "zero3" in RUNNABLE  # --strategy auto may pick it


def test_choose_respects_the_memory_limit_and_says_what_would_fit():
    prof, topo = _profile(), _swept(4, 1e-9)
    preds = [cost.predict(s, prof, topo) for s in cost.STRATEGIES]
    fastest = cost.choose(preds, None)
    assert fastest.step_s == min(p.step_s for p in preds)
    limit = sorted(p.peak_bytes for p in preds)[0]
    assert cost.choose(preds, limit).peak_bytes <= limit
    with pytest.raises(cost.PlanError, match="no strategy fits.*raise --memory-limit"):
        cost.choose(preds, limit - 1)


def test_predict_refuses_unknown_strategy_and_unshardable_world():
    with pytest.raises(cost.PlanError, match="unknown strategy 'zero4'"):
        cost.predict("zero4", _profile(), _swept(4, 1e-9))
    with pytest.raises(cost.PlanError, match="cannot shard"):
        cost.predict("zero3", _profile(params=3), _swept(4, 1e-9))


def test_parse_model():
    assert parse_model("small").n_embd == 128
    assert parse_model("n_layer=3,n_embd=64").n_layer == 3
    with pytest.raises(ConfigError, match="not a preset"):
        parse_model("bert")
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_model("n_layer=two")


def test_strategy_auto_picks_zero3_when_only_it_fits_this_hosts_memory(monkeypatch):
    from unbroken.config import ConfigError, RunConfig
    from unbroken.plan import command

    prof, topo = _profile(), _swept(4, 1e-9)
    monkeypatch.setattr(command.ranks, "topology", lambda *a, **k: topo)
    monkeypatch.setattr(command.profiles, "load_or_measure", lambda *a, **k: prof)
    cfg = RunConfig(world_size=4, shadows=0)
    preds = {p.strategy: p for p in command.plan_predictions(prof, topo, parity_group=4, protect_every=8,
                                                             schedule="unbroken")}
    monkeypatch.setattr(command, "memory_budget_bytes", lambda *a, **k: 10 ** 12)
    assert command.choose_for_run(cfg)[0] == "ddp"  # everything fits: the fastest
    others = min(preds[s].peak_bytes for s in ("ddp", "zero1"))
    assert preds["zero3"].peak_bytes < others
    monkeypatch.setattr(command, "memory_budget_bytes", lambda *a, **k: preds["zero3"].peak_bytes)
    strategy, why = command.choose_for_run(cfg)
    assert strategy == "zero3" and "ddp" in why and "does not fit" in why
    monkeypatch.setattr(command, "memory_budget_bytes", lambda *a, **k: preds["zero3"].peak_bytes - 1)
    with pytest.raises(ConfigError, match="no strategy fits.*smallest is zero3"):
        command.choose_for_run(cfg)


def _with_cpu_block(topo: Topology, block: float) -> Topology:
    sweeps = {c: [[n, s, block] for n, s in rows] for c, rows in topo.sweeps.items()}
    return Topology(world=topo.world, latency_s=topo.latency_s, bandwidth_Bps=topo.bandwidth_Bps, sweeps=sweeps)


def test_cpu_block_is_zero_with_two_cores_per_rank_and_the_used_share_of_a_rank_below():
    from unbroken.plan.probe import cpu_block

    assert cpu_block(0.9, 2.0) == cpu_block(3.0, 8.0) == 0.0  # the collective has a core of its own
    assert cpu_block(0.25, 0.5) == pytest.approx(0.5)  # 4 ranks on 2 cores: a quarter core is half a rank's share
    assert cpu_block(0.9, 0.5) == 1.0 and cpu_block(0.3, 1.0) == pytest.approx(0.3) and cpu_block(-0.1, 0.5) == 0.0


def test_a_collectives_cpu_work_cannot_hide_behind_compute_and_old_topologies_read_as_none():
    topo = _swept(4, 1e-9)
    assert topo.cpu_block("all_gather", 4096) == 0.0  # two-column sweeps: measured before cpu_block existed
    prof = _profile()
    for s in cost.STRATEGIES:
        free, bound, half = (cost.predict(s, prof, t) for t in (topo, _with_cpu_block(topo, 1.0),
                                                                _with_cpu_block(topo, 0.5)))
        assert free.step_s <= half.step_s <= bound.step_s  # more CPU-bound collectives never predict faster
        assert bound.comm_s == free.comm_s and bound.compute_s == pytest.approx(free.compute_s)
    two_buckets = _profile(tensor_elems=(300_000,) * 4, params=1_200_000)  # the first bucket's all-reduce overlaps
    ddp_free = cost.predict("ddp", two_buckets, topo)
    ddp_bound = cost.predict("ddp", two_buckets, _with_cpu_block(topo, 1.0))
    assert ddp_bound.step_s > ddp_free.step_s  # the buckets' all-reduce no longer overlaps backward
    with pytest.raises(TopologyError, match="cpu_block in \\[0, 1\\]"):
        _with_cpu_block(topo, 1.5)
