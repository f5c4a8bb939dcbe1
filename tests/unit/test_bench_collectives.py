"""`unbroken bench collectives`: its figures from records (pure), and one scenario in namespaces (root)."""
from __future__ import annotations

import pytest

from unbroken.bench import collectives as cb
from unbroken.plan.netns import available

MB = cb.MB


def _rec(method, secs, *, nbytes=4 * MB, start=0.0, plan=None, rnd=0, sha="a"):
    r = {"phase": "measure", "round": rnd, "method": method, "bytes": nbytes, "seconds": secs, "start": start,
         "sha": sha}
    if plan is not None:
        r["plan"] = plan
    return r


def test_figures_are_medians_of_time_ratios_over_congested_scenarios_and_payloads():
    runs = {"none": {"records": [_rec("gloo", 1.0), _rec("static", 1.0), _rec("adaptive", 1.02)], "changes": []},
            "one_slow": {"records": [_rec("gloo", 3.0), _rec("static", 3.0), _rec("adaptive", 2.0)], "changes": []},
            "two_slow": {"records": [_rec("gloo", 4.0), _rec("static", 6.0), _rec("adaptive", 4.0)], "changes": []}}
    res = cb.result(runs, world=4, fast=1000, slow=250, rounds=1, period=1.0)
    assert res["speedup_vs_static_congested"] == pytest.approx((1.5 + 1.5) / 2)
    assert res["speedup_vs_gloo_congested"] == pytest.approx((1.5 + 1.0) / 2)
    assert res["slowdown_vs_gloo_uncongested"] == pytest.approx(0.02)
    assert res["bitwise_equal"] and {r["scenario"] for r in res["rows"]} == set(runs)


def test_the_cpu_figure_is_the_median_cpu_ratio_over_the_uncongested_payloads():
    def recs(nbytes, gloo_cpu, ours_cpu):
        out = [_rec("gloo", 1.0, nbytes=nbytes), _rec("adaptive", 1.1, nbytes=nbytes)]
        out[0]["cpu_s"], out[1]["cpu_s"] = gloo_cpu, ours_cpu
        return out

    runs = {"none": {"records": recs(MB, 1.0, 3.0) + recs(4 * MB, 2.0, 3.0) + recs(16 * MB, 4.0, 4.0)
                     + recs(MB // 2, 1.0, 9.0), "changes": []}}  # under 1 MB: not in the figure
    res = cb.result(runs, world=4, fast=1000, slow=250, rounds=1, period=1.0)
    assert res["cpu_vs_gloo_uncongested"] == pytest.approx(1.5)  # ratios 3.0, 1.5, 1.0
    assert {r["bytes"]: r["median_cpu_s"] for r in res["rows"] if r["method"] == "gloo"}[4 * MB] == 2.0
    old = {"none": {"records": [_rec("gloo", 1.0), _rec("adaptive", 1.0)], "changes": []}}  # records before cpu_s
    assert cb.result(old, world=4, fast=1000, slow=250, rounds=1, period=1.0)["cpu_vs_gloo_uncongested"] is None


def test_payloads_under_one_megabyte_are_not_in_the_figures():
    runs = {"one_slow": {"records": [_rec("static", 9.0, nbytes=MB // 2), _rec("adaptive", 1.0, nbytes=MB // 2),
                                     _rec("gloo", 9.0, nbytes=MB // 2)], "changes": []}}
    assert cb.result(runs, world=4, fast=1, slow=0.5, rounds=1, period=1)["speedup_vs_static_congested"] is None


def test_replan_counts_collectives_on_the_old_plan_after_each_change():
    a, b = {"kind": "ring"}, {"kind": "pipelined"}
    recs = [_rec("adaptive", 1.0, start=s, plan=p) for s, p in
            ((0, a), (2, a), (4, a), (6, b), (8, b), (10, b), (12, a))]
    run = {"records": recs, "changes": [{"time": 2.5}, {"time": 9.5}]}
    # change at 2.5: the collective at 2 (in flight) and at 4 ran the old plan -> 2; at 9.5: the one at 10 -> 1
    assert cb.replan_counts(run) == [2, 1]
    run["changes"].append({"time": 13.5})  # no collective after it: not counted
    assert cb.replan_counts(run) == [2, 1]
    run["changes"] = [{"time": 0.5}, {"time": 4.5}]  # at 0.5 the plan never changed before the next change
    assert cb.replan_counts(run) == [None, 1]


def test_a_probe_after_a_change_is_not_its_new_plan():
    paced, probe, around = {"kind": "ring", "window": 4}, {"kind": "ring", "window": 0}, {"kind": "pipelined"}
    recs = [_rec("adaptive", 1.0, start=s, plan=p) for s, p in ((0, paced), (2, paced), (4, probe), (6, around))]
    recs[2]["probe"] = "slower"  # the even ring, run to read the links
    assert cb.replan_counts({"records": recs, "changes": [{"time": 1.5}]}) == [2]
    del recs[2]["probe"]  # the same pattern run as a plan is a new plan
    assert cb.replan_counts({"records": recs, "changes": [{"time": 1.5}]}) == [1]
    recs = [_rec("adaptive", 1.0, start=s, plan=p) for s, p in ((0, paced), (2, probe), (4, paced), (6, around))]
    recs[1]["probe"] = "every"  # the last collective before the change was a routine probe
    assert cb.replan_counts({"records": recs, "changes": [{"time": 3.5}]}) == [1]  # old plan: the paced ring


def test_a_last_change_too_close_to_the_end_is_not_judged():
    a = {"kind": "ring"}
    recs = [_rec("adaptive", 1.0, start=s, plan=a) for s in (0, 2, 4)]
    assert cb.replan_counts({"records": recs, "changes": [{"time": 3.5}]}) == []  # one collective after it
    recs += [_rec("adaptive", 1.0, start=s, plan=a) for s in (6, 8)]
    assert cb.replan_counts({"records": recs, "changes": [{"time": 3.5}]}) == [None]  # three, no new plan


def test_different_bits_between_static_and_adaptive_are_reported():
    runs = {"none": {"records": [_rec("static", 1.0, sha="x"), _rec("adaptive", 1.0, sha="y"), _rec("gloo", 1.0)],
                     "changes": []}}
    assert cb.result(runs, world=4, fast=1, slow=0.5, rounds=1, period=1)["bitwise_equal"] is False


@pytest.mark.slow
@pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")
def test_one_slow_link_scenario_runs_in_namespaces(tmp_path):
    run = cb.run_scenario("one_slow", world=3, payloads=[MB], rounds=1, fast=1000.0, slow=250.0, period=1.0,
                          tmp=tmp_path, port=29790, log=lambda m: None)
    methods = [r["method"] for r in run["records"] if r["phase"] == "measure"]
    assert sorted(methods) == sorted(cb.METHODS)
    res = cb.result({"one_slow": run}, world=3, fast=1000, slow=250, rounds=1, period=1)
    assert res["bitwise_equal"]
    said = res["warmup_events"]["one_slow"] + [e for r in res["rows"] for es in r.get("events", []) for e in es]
    assert {"kind": "link_congestion", "link": "up:1", "congested": True} in [
        {k: e.get(k) for k in ("kind", "link", "congested")} for e in said]  # rank 0's events, in the JSON


def test_each_adaptive_row_carries_what_was_said_before_each_round():
    said = [{"kind": "collective_plan", "seq": 5}]
    recs = [_rec("gloo", 1.0), _rec("static", 1.0), _rec("adaptive", 1.0) | {"events": said},
            _rec("adaptive", 1.0, rnd=1), {**_rec("adaptive", 1.0), "phase": "warmup",
                                           "events": [{"kind": "link_congestion"}]}]
    res = cb.result({"none": {"records": recs, "changes": []}}, world=4, fast=1, slow=0.5, rounds=2, period=1)
    assert [r["events"] for r in res["rows"] if r["method"] == "adaptive"] == [[said, []]]
    assert res["warmup_events"] == {"none": [{"kind": "link_congestion"}]}


@pytest.mark.parametrize("args,needle", [(["--scenarios", "bogus"], "unknown --scenarios bogus"),
                                         (["--slow-mbit", "2000"], "--slow-mbit < --fast-mbit"),
                                         (["--world-size", "3", "--scenarios", "two_slow"], "--world-size >= 4"),
                                         (["--payloads", "0"], "--payloads"),
                                         (["--only", "bogus"], "unknown --only bogus"),
                                         (["--only", "e2e", "--steps", "2"], "--steps >= 4"),
                                         (["--bucket-kb", "64"], "--bucket-kb is for --only e2e"),
                                         (["--only", "e2e", "--bucket-kb", "0"], "--bucket-kb must be >= 1")])
def test_bad_options_are_one_line_errors(args, needle):
    from typer.testing import CliRunner

    from unbroken.cli import app

    res = CliRunner().invoke(app, ["bench", "collectives", *args])
    assert res.exit_code == 2 and needle in res.output


def test_collectives_flag_is_validated():
    from unbroken.config import ConfigError, RunConfig

    assert RunConfig(collectives="adaptive").collectives == "adaptive"
    with pytest.raises(ConfigError, match="collectives must be one of"):
        RunConfig(collectives="fast")
    with pytest.raises(ConfigError, match="use --collectives gloo, or --backend gloo --device cpu"):
        RunConfig(collectives="adaptive", backend="nccl")


def test_e2e_figures_are_ratios_of_median_step_times():
    from unbroken.bench import collectives_e2e as e2e

    rec = lambda s: {"step_s": s, "steps_timed": 6, "plan_changes": 0, "last_plan": None}  # noqa: E731
    runs = {"gloo": [rec(1.2), rec(1.0), rec(1.4)], "static": [rec(1.5), rec(1.6), rec(1.7)],
            "adaptive": [rec(0.8), rec(0.9), rec(1.0)]}
    res = e2e.result(runs, world=4, fast=1000, slow=250, steps=10, rounds=3)
    assert res["step_s"] == {"gloo": 1.2, "static": 1.6, "adaptive": 0.9}
    assert res["speedup_vs_gloo"] == pytest.approx(1.2 / 0.9) and res["speedup_vs_static"] == pytest.approx(1.6 / 0.9)


def test_a_full_rewrite_keeps_the_e2e_section(tmp_path):
    import json

    path = tmp_path / "collectives.json"
    assert cb.kept_sections(path) == {}
    path.write_text(json.dumps({"e2e": {"speedup_vs_gloo": 1.3}, "rows": []}))
    assert cb.kept_sections(path) == {"e2e": {"speedup_vs_gloo": 1.3}}


def test_the_model_bound_is_what_the_planner_predicts_and_rows_get_their_efficiency():
    from unbroken.comm import planner
    from unbroken.comm.patterns import Pattern

    nbytes, plan = 64 * MB, {"kind": "pipelined", "order": [0, 1, 2, 3], "split": [1, 0, 1, 1], "pieces": 32,
                             "aggregators": []}
    runs = {"one_slow": {"records": [_rec("static", 4.0, nbytes=nbytes), _rec("gloo", 3.6, nbytes=nbytes),
                                     _rec("adaptive", 2.5, nbytes=nbytes, plan=plan)], "changes": []}}
    res = cb.result(runs, world=4, fast=1000, slow=250, rounds=1, period=1)
    links = planner.Rates(up=(125e6, 31.25e6, 125e6, 125e6), down=(125e6, 31.25e6, 125e6, 125e6))
    ring = planner.predict(Pattern.static_ring(4, planner.pieces_for(nbytes)), nbytes, links)
    assert res["model_speedup_vs_static_congested"] == pytest.approx(ring / planner.choose(None, links, nbytes)[1])
    assert 1.3 < res["model_speedup_vs_static_congested"] < 1.5  # the slow rank's bytes: at most 2(N-1)/N
    by = {r["method"]: r for r in res["rows"]}
    assert by["static"]["efficiency"] == pytest.approx(ring / 4.0)
    assert by["adaptive"]["model_s"] == pytest.approx(planner.predict(Pattern.from_json(plan), nbytes, links))
    assert "model_s" not in by["gloo"]


def _cell_rows(static: list[float], adaptive: list[float], scenario: str = "one_slow", nbytes: int = 4 * MB):
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 - odd counts only
    return [{"scenario": scenario, "bytes": nbytes, "method": m, "seconds": xs, "median_s": med(xs)}
            for m, xs in (("static", static), ("adaptive", adaptive))]


def test_the_interval_holds_the_figure_and_is_a_point_when_every_round_agrees():
    from unbroken.bench.collectives_ci import figure_ci

    same = _cell_rows([3.0] * 5, [2.0] * 5)
    assert figure_ci(same, ("one_slow",), "static", "adaptive") == [1.5, 1.5]
    noisy = _cell_rows([3.0, 3.3, 2.9, 3.6, 3.1], [2.0, 2.4, 1.9, 2.1, 2.2]) + \
        _cell_rows([6.0, 6.1, 5.0, 6.6, 5.9], [4.0, 4.4, 3.9, 4.1, 5.0], scenario="two_slow")
    lo, hi = figure_ci(noisy, ("one_slow", "two_slow"), "static", "adaptive")
    cells = sorted(s["median_s"] / a["median_s"] for s, a in zip(noisy[::2], noisy[1::2]))  # the figure's cells
    assert lo < (cells[0] + cells[1]) / 2 < hi and hi - lo > 0.05


def test_the_interval_pairs_rounds_so_a_round_slow_for_both_methods_moves_nothing():
    from unbroken.bench.collectives_ci import figure_ci

    slow_rounds = [1.0, 3.0, 1.0, 5.0, 1.0]  # some rounds slow for everyone (a busy host)
    rows = _cell_rows([3 * x for x in slow_rounds], [2 * x for x in slow_rounds])
    assert figure_ci(rows, ("one_slow",), "static", "adaptive") == pytest.approx([1.5, 1.5])
    assert figure_ci(rows, ("none",), "static", "adaptive") is None  # no cell of those scenarios


def test_the_result_carries_an_interval_for_each_time_figure():
    runs = {"none": {"records": [_rec("gloo", 1.0), _rec("static", 1.0), _rec("adaptive", 1.02)], "changes": []},
            "one_slow": {"records": [_rec("gloo", 3.0), _rec("static", 3.0), _rec("adaptive", 2.0)], "changes": []}}
    res = cb.result(runs, world=4, fast=1000, slow=250, rounds=1, period=1.0)
    assert res["speedup_vs_static_congested_ci95"] == pytest.approx([1.5, 1.5])
    assert res["slowdown_vs_gloo_uncongested_ci95"] == pytest.approx([0.02, 0.02])
    assert "speedup_vs_static_congested 1.500 [1.500, 1.500]" in cb._figures_line(res)
