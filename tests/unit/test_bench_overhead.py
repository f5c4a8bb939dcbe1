"""`unbroken bench overhead`'s pure parts: windows, mean ratios, the bootstrap CI, decomposition, schema."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.bench import native_job
from unbroken.bench import overhead as ov
from unbroken.bench.common import git_commit, write_result
from unbroken.config import STRATEGIES, RunConfig
from unbroken.events import Event

_times = st.floats(min_value=0.05, max_value=2.0, allow_nan=False)
_runs = st.lists(st.lists(_times, min_size=2, max_size=8), min_size=1, max_size=4)


def _recs(times: list[float], *, update: float = 0.1) -> list[dict]:
    """Step records for steps 1..n with the given step_s (unbroken-like phase fields)."""
    return [{"step": i + 1, "step_s": t, "compute_s": 0.5 * t, "allreduce_s": 0.1, "update_s": update,
             "allgather_s": 0.05} for i, t in enumerate(times)]


# --- windows and configs ----------------------------------------------------------------------
def test_steady_window_skips_warmup_and_keeps_whole_periods():
    assert ov.steady_window(40, skip=2, period=8) == (3, 34)      # 32 steps = 4 periods
    assert ov.steady_window(40, skip=2, period=1) == (3, 40)
    assert ov.steady_window(10, skip=2, period=40) == (3, 10)     # no whole period fits: all steady steps
    with pytest.raises(ValueError, match="steady step"):
        ov.steady_window(3, skip=2)


def test_period_is_lcm_of_parity_and_checkpoint_periods():
    assert ov.period(8, 0) == 8 and ov.period(8, 10) == 40 and ov.period(1, 0) == 1
    assert ov.period("auto", 0) == 1 and ov.period("auto", 6) == 6 and ov.period(None, 0) == 1


def test_checkpoint_touches_its_step_and_the_next():
    assert [s for s in range(1, 13) if ov.checkpoint_touched(s, 5)] == [5, 6, 10, 11]
    assert not any(ov.checkpoint_touched(s, 0) for s in range(1, 10))
    assert all(ov.checkpoint_touched(s, 1) for s in range(1, 10))


def test_variant_configs():
    off = ov.variant_config("off", "ddp", 2, 40)
    assert (off.tier1, off.checkpoint_every, off.strategy, off.world_size, off.steps) == (False, 0, "ddp", 2, 40)
    d = ov.variant_config("default", "zero1", 4, 40)
    assert d == RunConfig(strategy="zero1", world_size=4, steps=40)
    assert ov.default_protection()["checkpoint_every"] == RunConfig().checkpoint_every
    with pytest.raises(ValueError, match="unknown variant"):
        ov.variant_config("fast", "ddp", 2, 40)


def test_every_strategy_has_a_peer_and_unknown_ones_fall_back_to_ddp():
    for s in STRATEGIES:
        assert native_job.peer_for(s)["fallback"] is False
    assert native_job.peer_for("zero1")["optimizer"] == "zero" and native_job.peer_for("ddp")["optimizer"] == "adamw"
    fb = native_job.peer_for("fsdp9")
    assert fb["fallback"] is True and fb["optimizer"] == "adamw" and "fsdp9" in fb["note"]


def test_native_command_has_no_restarts_no_checkpoints_and_the_peer_optimizer():
    s = " ".join(native_job.native_command(Path("/r"), nproc=2, port=1234, optimizer="zero"))
    assert "--max-restarts 0" in s and "--checkpoint-every 0" in s and s.endswith("--optimizer zero")
    assert "--kill" not in s


def test_native_step_records_keep_rank0_first_incarnation():
    recs = [{"t": 1.0, "event": "step", "rank": 0, "restart": 0, "step": 2, "step_s": 0.2},
            {"t": 0.5, "event": "step", "rank": 0, "restart": 0, "step": 1, "step_s": 0.1},
            {"t": 0.6, "event": "step", "rank": 1, "restart": 0, "step": 1, "step_s": 0.9},
            {"t": 0.7, "event": "ready", "rank": 0, "restart": 0, "loaded_step": 0}]
    assert native_job.step_records(recs) == [{"step": 1, "step_s": 0.1}, {"step": 2, "step_s": 0.2}]


# --- ratios and the bootstrap -----------------------------------------------------------------
def test_ratio_uses_means_not_medians():
    native = [[1.0, 1.0, 1.0, 1.0]]
    spiky = [[1.0, 1.0, 1.0, 5.0]]        # median 1.0, mean 2.0: one slow (parity) step in four
    assert ov.mean_ratio(native, spiky) == pytest.approx(0.5)
    lo, hi = ov.bootstrap_ci(native, spiky)
    assert lo <= 0.5 <= hi and lo < 0.5


def test_mean_ratio_needs_paired_rounds_and_steps():
    with pytest.raises(ValueError, match="paired rounds"):
        ov.mean_ratio([[1.0]], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="at least one steady step"):
        ov.mean_ratio([[]], [[1.0]])


@settings(max_examples=40, deadline=None)
@given(base=_runs, data=st.data())
def test_ci_contains_the_point_estimate(base, data):
    var = [data.draw(st.lists(_times, min_size=2, max_size=8)) for _ in base]
    lo, hi = ov.bootstrap_ci(base, var, resamples=300)
    assert lo <= ov.mean_ratio(base, var) <= hi


@settings(max_examples=15, deadline=None)
@given(base=st.lists(st.lists(_times, min_size=4, max_size=8), min_size=3, max_size=4), data=st.data())
def test_ci_narrows_with_more_identical_data(base, data):
    var = [data.draw(st.lists(_times, min_size=4, max_size=8)) for _ in base]
    lo1, hi1 = ov.bootstrap_ci(base, var, resamples=1000)
    lo4, hi4 = ov.bootstrap_ci(base * 4, var * 4, resamples=1000)
    assert hi4 - lo4 <= (hi1 - lo1) + 1e-9


def test_ci_narrows_strictly_on_noisy_data_and_is_seeded():
    base = [[1.0, 1.2, 0.9, 1.1], [1.3, 1.0, 1.1, 0.95], [1.05, 1.0, 1.2, 0.9]]
    var = [[1.1, 1.4, 1.0, 1.0], [1.2, 1.1, 1.3, 1.0], [1.0, 1.25, 1.1, 1.05]]
    w1 = (lambda c: c[1] - c[0])(ov.bootstrap_ci(base, var))
    w4 = (lambda c: c[1] - c[0])(ov.bootstrap_ci(base * 4, var * 4))
    assert 0 < w4 < 0.7 * w1
    assert ov.bootstrap_ci(base, var, seed=7) == ov.bootstrap_ci(base, var, seed=7)
    assert ov.bootstrap_ci(base, var, seed=7) != ov.bootstrap_ci(base, var, seed=8)


def test_identical_runs_give_a_zero_width_ci_at_one():
    runs = [[0.5, 0.5, 0.5]] * 3
    assert ov.bootstrap_ci(runs, runs) == pytest.approx((1.0, 1.0))


# --- decomposition ----------------------------------------------------------------------------
def _cell_runs(checkpoint_every: int, rounds: int = 2) -> dict:
    native = _recs([1.0] * 10, update=0.1)
    off = _recs([1.1] * 10, update=0.1)
    # default: every 4th step +0.4 in the update phase (parity); checkpoint-touched steps +0.3 more
    dflt = []
    for r in _recs([1.1] * 10, update=0.1):
        extra = 0.4 if r["step"] % 4 == 0 else 0.0
        ck = 0.3 if ov.checkpoint_touched(r["step"], checkpoint_every) else 0.0
        dflt.append({**r, "step_s": r["step_s"] + extra + ck, "update_s": r["update_s"] + extra})
    return {"native": [native] * rounds, "off": [off] * rounds, "default": [dflt] * rounds}


def test_decomposition_splits_runtime_tier1_tier2_and_adds_up():
    runs = _cell_runs(checkpoint_every=5)
    d = ov.decompose(runs, checkpoint_every=5)
    assert d["runtime"] == pytest.approx(0.1)
    assert d["runtime"] + d["tier1"] + d["tier2"] == pytest.approx(d["total"])
    assert d["tier2_separable"] is True and d["tier2"] > 0
    assert d["tier1_update"] == pytest.approx(d["tier1"])          # the parity work is all in the update phase
    assert d["checkpoint_steps_per_run"] == 3                      # steps 5, 6 and 10 of 1..10
    assert set(d["phases_s"]["native"]) >= {"compute_s", "update_s"}


def test_decomposition_without_tier2_and_when_tier2_cannot_be_separated():
    d0 = ov.decompose(_cell_runs(checkpoint_every=0), checkpoint_every=0)
    assert d0["tier2"] == 0.0 and d0["tier1"] == pytest.approx(0.4 * 2 / 10)   # steps 4 and 8 of 10
    d1 = ov.decompose(_cell_runs(checkpoint_every=1), checkpoint_every=1)
    assert d1["tier2"] is None and d1["tier2_separable"] is False
    assert d1["runtime"] + d1["tier1"] == pytest.approx(d1["total"])


# --- the result schema, table, figure ---------------------------------------------------------
def _fake_result(steps: int = 12, rounds: int = 2) -> dict:
    def cell(slow: float) -> dict:
        return {"runs": {"native": [_recs([1.0] * steps)] * rounds, "off": [_recs([1.0 + slow] * steps)] * rounds,
                         "default": [_recs([1.0 + slow] * (steps - 1) + [1.0 + 4 * slow])] * rounds},
                "peer": native_job.peer_for("zero1")}

    cells = {"zero1": {"2": cell(0.005), "4": cell(0.2)}, "ddp": {"2": cell(0.0)}}
    return ov.overhead_result(cells, steps=steps, rounds=rounds, worlds=[2, 4],
                              protection={"protect_every": 1, "checkpoint_every": 0}, skip=2)


def test_result_schema_from_fake_samples():
    r = _fake_result()
    for key in ("ratio", "ci95", "ratio_off", "ci95_off", "protect_every", "checkpoint_every", "rounds", "steps",
                "worlds", "goal", "goal_met", "median_step_s", "mean_step_s", "decomposition"):
        assert key in r
    assert set(r["ratio"]) == {"zero1", "ddp"} and set(r["ratio"]["zero1"]) == {"2", "4"}
    assert r["goal"] == 0.98 and r["rounds"] == 2 and r["steps"] == 12 and r["worlds"] == [2, 4]
    assert r["ratio_off"]["ddp"]["2"] == pytest.approx(1.0) and r["ratio"]["ddp"]["2"] == pytest.approx(1.0)
    lo, hi = r["ci95"]["zero1"]["4"]
    assert lo <= r["ratio"]["zero1"]["4"] <= hi < 0.98
    assert r["goal_met"]["zero1"]["2"] is True and r["goal_met"]["zero1"]["4"] is False
    med, mean = r["median_step_s"]["zero1"]["4"], r["mean_step_s"]["zero1"]["4"]
    assert med["default"] == pytest.approx(1.2) and mean["default"] > med["default"]   # the slow last step
    assert r["ratio"]["zero1"]["4"] == pytest.approx(1.0 / mean["default"])
    assert r["window"]["zero1"]["2"] == [3, 12] and len(r["samples"]["zero1"]["2"]["native"][0]) == 10
    json.dumps(r)  # serializable as is


def test_table_and_plot_render(tmp_path):
    from rich.console import Console

    from unbroken.bench.plot import plot_overhead

    r = _fake_result()
    con = Console(record=True, width=240)
    con.print(ov.table(r))
    text = con.export_text()
    assert "zero1" in text and "ddp" in text and "tier 1" in text
    plot_overhead(r, tmp_path / "o.png")
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_unbroken_records_dedupe_redone_steps(monkeypatch):
    evs = [Event(time=float(i), kind="step", rank=rank, fields={"step": s, "step_s": v, "update_s": 0.1})
           for i, (rank, s, v) in enumerate([(0, 1, 0.5), (1, 1, 0.9), (0, 2, 0.6), (0, 2, 0.7)])]
    evs.append(Event(time=9.0, kind="protect_config", rank=0, fields={"protect_every": 6}))
    monkeypatch.setattr(ov, "job_events", lambda d: evs)
    recs, chosen = ov._unbroken_records(Path("/nowhere"))
    assert recs == [{"step": 1, "step_s": 0.5, "update_s": 0.1}, {"step": 2, "step_s": 0.7, "update_s": 0.1}]
    assert chosen == 6


def test_write_result_records_the_commit(tmp_path):
    d = json.loads(write_result("x", {"a": 1}, tmp_path).read_text())
    assert "commit" in d and "dirty" in d
    assert git_commit(tmp_path) == {"commit": None, "dirty": None}


def test_overhead_command_is_registered_and_rejects_bad_options():
    from typer.testing import CliRunner

    from unbroken.cli import app

    runner = CliRunner()
    assert "overhead" in runner.invoke(app, ["bench", "--help"]).output
    for args in (["--worlds", "2,x"], ["--strategies", "nope"], ["--steps", "3"], ["--rounds", "0"]):
        res = runner.invoke(app, ["bench", "overhead", *args])
        assert res.exit_code == 2, args


def test_every_strategy_is_measured_by_default():
    from unbroken.bench.command import _strategies

    assert _strategies("") == list(STRATEGIES) and _strategies("ddp") == ["ddp"]
