"""`unbroken bench plan`: the planner's predictions against measured step times on four wirings.

The model's profile is measured once (on this host, `ranks_per_host` = world). Then, per
wiring (loopback; every link 1 Gbit/s; every link 200 Mbit/s; one 50 Mbit/s link among
unshaped ones), its topology is measured inside the wiring's namespaces and every strategy
runs there with PyTorch's own implementation (`plan.native_job`), the strategies
interleaved over `rounds`. The prediction for each (strategy, wiring) is made from that
wiring's topology and the profile alone. Goals: median |error| <= 10 %, max <= 20 %, the
choice the measured fastest or within 5 % of it on every wiring, and under a memory limit
(each strategy's measured peak in turn) a choice whose measured peak fits.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from rich.table import Table

from unbroken.plan import cost, native_job, ranks
from unbroken.plan.netns import Netns, Wiring, available
from unbroken.plan.profile import ModelProfile, measure as measure_profile, parse_model

GOAL_MEDIAN, GOAL_MAX, GOAL_CHOICE = 0.10, 0.20, 0.05


def wirings(world: int) -> list[Wiring | None]:
    """None = loopback (no namespaces)."""
    return [None, Wiring.uniform("1gbit", world, 1000), Wiring.uniform("200mbit", world, 200),
            Wiring.one_slow("one-50mbit", world, None, 50)]


def _measure_wiring(wiring: Wiring | None, prof: ModelProfile, model, *, world: int, batch_size: int, steps: int,
                    rounds: int, tmp: Path, log) -> dict:
    name = wiring.name if wiring else "loopback"
    net = Netns(wiring) if wiring else None
    try:
        if net:
            net.__enter__()
        topo = ranks.topology(world, tmp / f"topo-{name}.json", net=net, max_bytes=16 << 20, op_budget_s=1.0,
                              label=name)
        runs: dict[str, list[dict]] = {s: [] for s in cost.STRATEGIES}
        for r in range(rounds):
            for s in cost.STRATEGIES:
                log(f"{name}: {s} round {r + 1}/{rounds}")
                runs[s].append(native_job.run(s, world, tmp / f"{name}-{s}-{r}.json", net=net, model=model,
                                              batch_size=batch_size, steps=steps))
    finally:
        if net:
            net.close()
    rows = []
    for s in cost.STRATEGIES:
        pred = cost.predict(s, prof, topo)
        per_run = [run["ranks"][0]["median_step_s"] for run in runs[s]]
        measured = statistics.median(per_run)
        ranks0 = runs[s][-1]["ranks"]
        rows.append({"wiring": name, "strategy": s, "predicted_s": pred.step_s, "measured_s": measured,
                     "measured_runs_s": per_run, "error": (pred.step_s - measured) / measured,
                     "predicted_exposed_comm_s": pred.exposed_comm_s, "predicted_comm_s": pred.comm_s,
                     "predicted_peak_bytes": pred.peak_bytes, "measured_peak_bytes": max(x["peak_tensor_bytes"] for x in ranks0),
                     "measured_state_bytes": ranks0[0]["state_bytes"]["total"], "predicted_state_bytes": pred.state_bytes,
                     "bytes_sent_per_step": ranks0[0]["bytes_sent_per_step"]})
    return {"wiring": name, "rates_mbit": list(wiring.rates_mbit) if wiring else None,
            "ring_alpha_s": topo.ring_alpha_beta()[0], "ring_bandwidth_Bps": 1 / max(topo.ring_alpha_beta()[1], 1e-12),
            "rows": rows, "choice": _choice(rows, prof, topo)}


def _choice(rows: list[dict], prof: ModelProfile, topo) -> dict:
    preds = [cost.predict(s, prof, topo) for s in cost.STRATEGIES]
    measured = {r["strategy"]: r["measured_s"] for r in rows}
    peaks = {r["strategy"]: r["measured_peak_bytes"] for r in rows}
    chosen = cost.choose(preds, None).strategy
    fastest = min(measured, key=measured.get)
    limits = []
    for s, limit in sorted(peaks.items(), key=lambda kv: kv[1]):  # each measured peak in turn as the limit
        try:
            pick = cost.choose(preds, limit).strategy
        except cost.PlanError:
            pick = None
        limits.append({"limit_bytes": limit, "chosen": pick, "chosen_measured_peak_bytes": peaks.get(pick),
                       "fits": pick is None or peaks[pick] <= limit})
    return {"chosen": chosen, "measured_fastest": fastest, "slowdown": measured[chosen] / measured[fastest] - 1,
            "within_5pct": measured[chosen] <= (1 + GOAL_CHOICE) * measured[fastest], "under_limits": limits}


def measure(*, world: int = 4, model_spec: str = "small", batch_size: int = 8, steps: int = 12, rounds: int = 2,
            log=print) -> dict:
    why = available()
    if why:
        raise RuntimeError(f"bench plan shapes links in network namespaces: {why}")
    model = parse_model(model_spec)
    log(f"profiling {model_spec} on {world} local processes")
    prof = measure_profile(model, batch_size=batch_size, ranks_per_host=world)
    with tempfile.TemporaryDirectory() as tmp:
        wired = [_measure_wiring(w, prof, model, world=world, batch_size=batch_size, steps=steps, rounds=rounds,
                                 tmp=Path(tmp), log=log) for w in wirings(world)]
    rows = [r for w in wired for r in w["rows"]]
    errors = [abs(r["error"]) for r in rows]
    mem_err = [abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1) for r in rows]
    res = {"world": world, "model": model_spec, "batch_size": batch_size, "steps": steps, "rounds": rounds,
           "profile": prof.to_dict(), "wirings": wired, "rows": rows,
           "median_error": statistics.median(errors), "max_error": max(errors),
           "choice_within_5pct": all(w["choice"]["within_5pct"] for w in wired),
           "memory_limit_respected": all(x["fits"] for w in wired for x in w["choice"]["under_limits"]),
           "memory_median_error": statistics.median(mem_err), "memory_max_error": max(mem_err),
           "implementation": {s: native_job.IMPLEMENTATION[s] for s in cost.STRATEGIES}}
    res["goals"] = {"median_error": res["median_error"] <= GOAL_MEDIAN, "max_error": res["max_error"] <= GOAL_MAX,
                    "choice_within_5pct": res["choice_within_5pct"], "memory_limit": res["memory_limit_respected"]}
    return res


def table(res: dict) -> Table:
    t = Table(title=f"planner vs measured: {res['model']} on {res['world']} ranks (PyTorch's implementations)")
    for col in ("wiring", "strategy", "predicted ms", "measured ms", "error", "choice"):
        t.add_column(col)
    for w in res["wirings"]:
        for r in w["rows"]:
            mark = ("chosen" if r["strategy"] == w["choice"]["chosen"] else "") + \
                   (" fastest" if r["strategy"] == w["choice"]["measured_fastest"] else "")
            t.add_row(w["wiring"], r["strategy"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                      f"{r['error']:+.1%}", mark.strip())
    g = res["goals"]
    t.caption = (f"median |error| {res['median_error']:.1%} (goal <= 10%: {g['median_error']}), max {res['max_error']:.1%} "
                 f"(<= 20%: {g['max_error']}); choice within 5% everywhere: {g['choice_within_5pct']}; "
                 f"memory limit respected: {g['memory_limit']}")
    return t


def plot(res: dict, path: Path) -> None:
    from unbroken.figures import plt, save_png

    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=120)
    try:
        markers = dict(zip(cost.STRATEGIES, "osD^"))
        for i, w in enumerate(res["wirings"]):
            for r in w["rows"]:
                ax.scatter(r["measured_s"] * 1e3, r["predicted_s"] * 1e3, color=f"C{i}", marker=markers[r["strategy"]],
                           label=f"{w['wiring']}" if r["strategy"] == cost.STRATEGIES[0] else None)
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in res["rows"]) * 1e3 * 1.1
        ax.plot([0, hi], [0, hi], color="grey", linewidth=0.8)
        ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="grey", alpha=0.12, label="±20%")
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel("measured step, ms"), ax.set_ylabel("predicted step, ms")
        ax.set_title("marker: " + ", ".join(f"{m} {s}" for s, m in markers.items()), fontsize=8)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, alpha=0.3, which="both")
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)
