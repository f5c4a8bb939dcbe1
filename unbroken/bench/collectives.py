"""`unbroken bench collectives`: gloo's all-reduce, our static ring and the congestion-aware one, on shaped links.

Each rank runs in its own network namespace (plan/netns.py: veth + bridge, `tc tbf` per link),
`bench/collectives_job.py` on each. Scenarios, every link at `fast` Mbit/s except:

    none        nothing else
    one_slow    rank 1's link at `slow`
    two_slow    ranks 1 and 2 at `slow`
    background  one TCP stream from rank 2 to rank 3 for the whole scenario (bounded bytes and time)
    changing    rank 1's link switches between fast and slow every `period` s (`tc` on a timer), one
                payload, many rounds: a time series of algbw and of the adaptive plan

Methods are interleaved round by round in one run, after WARMUP untimed 16 MB collectives of each
(3 before stop 55), each payload's timed rounds after WARMUP_EACH untimed collectives of every
method at that size (records before stop 55 timed its first).
algbw = payload bytes / the slowest rank's time. Figures (medians over rounds, then over scenarios
and payloads >= 1 MB):
speedup_vs_static_congested and speedup_vs_gloo_congested over one_slow, two_slow and
background; slowdown_vs_gloo_uncongested over none (adaptive / gloo - 1); cpu_vs_gloo_uncongested,
the same for the CPU the ranks spent (adaptive / gloo; each cell's `median_cpu_s`); replan_collectives:
per rate change in `changing`, how many adaptive collectives ran on the old plan after the change
(the one in flight included) before a new plan was in use. Each of the first three has a 95 %
interval beside it (`..._ci95`: a paired bootstrap over rounds, bench/collectives_ci.py).

What the links allow, by the planner's own cost model (comm/planner.py `predict`) at the nominal
rates (the background stream is not in it: those links count as fast): per static/adaptive row
`model_s` (that plan's predicted time) and `efficiency` (model_s / median_s); and
`model_speedup_vs_static_congested`, the figure's median as the model predicts it for the plan
the planner picks with the true rates, i.e. the most re-planning can win here.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.table import Table

from unbroken.bench.collectives_ci import figure_ci
from unbroken.comm import native_ring, planner
from unbroken.comm.patterns import Pattern
from unbroken.plan.netns import Netns, Wiring

SCENARIOS = ("none", "one_slow", "two_slow", "background", "changing")
WARMUP = 8  # untimed 16 MB collectives of every method before any payload: the adaptive one flags, plans and judges
WARMUP_EACH = 1  # untimed collectives of every method at each payload before its timed rounds
CONGESTED = ("one_slow", "two_slow", "background")
METHODS = ("gloo", "static", "adaptive")
MB = 1 << 20
_PORT = 29750
_JOB = [sys.executable, "-m", "unbroken.bench.collectives_job"]


def rates(scenario: str, world: int, fast: float, slow: float) -> tuple[float, ...]:
    slow_ranks = {"one_slow": {1}, "two_slow": {1, 2}}.get(scenario, set())
    return tuple(slow if r in slow_ranks else fast for r in range(world))


def _env(net: Netns, rank: int) -> dict:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("MASTER_", "UNBROKEN_")) or k.startswith("UNBROKEN_NATIVE")}
    return {**keep, **net.env(rank), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _spawn(net: Netns, rank: int, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([*net.exec_prefix(rank), *_JOB, *args], env=_env(net, rank), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _reap(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every process until the deadline; kill (by process group) whatever is left."""
    end = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


class _Toggler:
    """Switches rank 1's link between fast and slow every `period` s once the job measures."""

    def __init__(self, net: Netns, out: Path, fast: float, slow: float, period: float) -> None:
        self.net, self.out, self.fast, self.slow, self.period = net, out, fast, slow, period
        self.changes: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-tc-timer")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and not (self.out.exists() and '"measure"' in self.out.read_text()):
            self._stop.wait(0.05)
        slow = False
        while not self._stop.wait(self.period):
            slow = not slow
            rate = self.slow if slow else self.fast
            self.net.set_rate(1, rate)
            self.changes.append({"time": time.time(), "rank": 1, "rate_mbit": rate})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(30)
        return self.changes


def run_scenario(scenario: str, *, world: int, payloads: list[int], rounds: int, fast: float, slow: float,
                 period: float, tmp: Path, port: int, log=print) -> dict:
    """One scenario's records (rank 0's JSON lines) and, for `changing`, the rate changes."""
    out = tmp / f"{scenario}.jsonl"
    args = ["rank", "--world", str(world), "--port", str(port), "--out", str(out),
            "--payloads", ",".join(map(str, payloads)), "--rounds", str(rounds),
            "--warmup", str(WARMUP), "--warmup-each", str(WARMUP_EACH)]
    with Netns(Wiring(name=scenario, rates_mbit=rates(scenario, world, fast, slow))) as net:
        args += ["--host", net.address(0)]
        extra, toggler = [], None
        if scenario == "background":  # rank 2 -> rank 3, no more than 5 minutes of the fast link's bytes
            secs = 300.0
            extra.append(_spawn(net, 3, ["sink", "--host", net.address(3), "--port", str(port + 1),
                                         "--seconds", str(secs)], tmp / "sink.out"))
            extra.append(_spawn(net, 2, ["source", "--host", net.address(3), "--port", str(port + 1),
                                         "--seconds", str(secs), "--bytes", str(int(fast * 1e6 / 8 * secs))],
                                tmp / "source.out"))
        procs = [_spawn(net, r, [*args, "--rank", str(r)], tmp / f"{scenario}-rank{r}.out") for r in range(world)]
        if scenario == "changing":
            toggler = _Toggler(net, out, fast, slow, period)
        try:
            _reap(procs, timeout_s=3600)
        finally:
            changes = toggler.stop() if toggler else []
            for p in extra:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode for p in procs):
        tail = (tmp / f"{scenario}-rank0.out").read_text(errors="replace").splitlines()[-6:]
        raise RuntimeError(f"bench collectives: scenario {scenario} failed (exits {[p.returncode for p in procs]}): "
                           f"{tail}")
    recs = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    log(f"collectives: {scenario}: {len(recs)} collectives")
    return {"records": recs, "changes": changes}


def measure(*, world: int, payloads: list[int], rounds: int, fast: float, slow: float, changing_payload: int,
            changing_rounds: int, period: float, scenarios: tuple[str, ...] = SCENARIOS, log=print) -> dict:
    runs = {}
    native = native_ring.build()  # before any rank starts: a build never runs inside a collective
    log(f"collectives: our ring walks {'in Python: ' + native if native else 'compiled'}")
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-collectives-") as tmp:
        for i, sc in enumerate(scenarios):
            log(f"collectives: scenario {sc} ({i + 1}/{len(scenarios)})")
            if sc == "changing":
                runs[sc] = run_scenario(sc, world=world, payloads=[changing_payload], rounds=changing_rounds,
                                        fast=fast, slow=slow, period=period, tmp=Path(tmp), port=_PORT + 4 * i, log=log)
            else:
                runs[sc] = run_scenario(sc, world=world, payloads=payloads, rounds=rounds, fast=fast, slow=slow,
                                        period=period, tmp=Path(tmp), port=_PORT + 4 * i, log=log)
    return {**result(runs, world=world, fast=fast, slow=slow, rounds=rounds, period=period),
            "ring_walk": "compiled" if native is None else f"python ({native})"}


def rows_of(runs: dict) -> list[dict]:
    """One row per scenario x payload x method: median seconds over rounds and algbw."""
    rows = []
    for sc, run in runs.items():
        recs = [r for r in run["records"] if r["phase"] == "measure"]
        for nbytes in sorted({r["bytes"] for r in recs}):
            for m in METHODS:
                cell = [r for r in recs if r["bytes"] == nbytes and r["method"] == m]
                if cell:
                    secs = [r["seconds"] for r in cell]
                    med = statistics.median(secs)
                    cpu = [r["cpu_s"] for r in cell if "cpu_s" in r]  # records before stop 49 have none
                    rows.append({"scenario": sc, "bytes": nbytes, "method": m, "seconds": secs, "median_s": med,
                                 "algbw_GBps": nbytes / med / 1e9,
                                 "median_cpu_s": statistics.median(cpu) if cpu else None})
                    if m == "adaptive":  # which plans ran, and what learning cost (waiting for the last rank included)
                        rows[-1]["plans"] = [r.get("plan") for r in cell]
                        rows[-1]["sync_s"] = [r.get("sync_s") for r in cell]
                        rows[-1]["plan_s"] = [r.get("plan_s") for r in cell]
                        rows[-1]["events"] = [r.get("events", []) for r in cell]  # said before each round ran
    return rows


def _nominal(scenario: str, world: int, fast: float, slow: float) -> planner.Rates:
    r = tuple(m * 1e6 / 8 for m in rates(scenario, world, fast, slow))
    return planner.Rates(up=r, down=r)


def add_model(rows: list[dict], *, world: int, fast: float, slow: float) -> list[float]:
    """Each static/adaptive row's `model_s` and `efficiency` (in place); per congested scenario x
    payload >= 1 MB, the model's static / best-plan time ratio (the figure's bound)."""
    bound = []
    for r in rows:
        links = _nominal(r["scenario"], world, fast, slow)
        if r["method"] == "static":
            plan = Pattern.static_ring(world, planner.pieces_for(r["bytes"]))
            if r["scenario"] in CONGESTED and r["bytes"] >= MB:
                bound.append(planner.predict(plan, r["bytes"], links) / planner.choose(None, links, r["bytes"])[1])
        elif r["method"] == "adaptive" and r.get("plans") and r["plans"][-1]:
            plan = Pattern.from_json(r["plans"][-1])
        else:
            continue
        r["model_s"] = planner.predict(plan, r["bytes"], links)
        r["efficiency"] = r["model_s"] / r["median_s"]
    return bound


def _ratios(rows: list[dict], scenarios: tuple[str, ...], num: str, den: str, key: str = "median_s") -> list[float]:
    """time(num) / time(den) (or another `key` of the rows: CPU) per scenario x payload >= 1 MB."""
    by = {(r["scenario"], r["bytes"], r["method"]): r.get(key) for r in rows}
    return [by[(sc, b, num)] / by[(sc, b, den)] for sc, b, m in by
            if m == den and sc in scenarios and b >= MB and by.get((sc, b, num)) and by[(sc, b, den)]]


JUDGED_AFTER = 3  # the goal's window: a last change the run ended sooner after, with no new plan yet, is not judged


def replan_counts(run: dict) -> list[int | None]:
    """Per rate change: adaptive collectives that ended after it on the old plan before a new plan
    ran (a probe, the even ring run to read the links, counts as the old plan: it re-plans nothing,
    and the old plan is the last one before the change that was not a probe);
    None when none ran before the next change, or before the run ended when at least
    JUDGED_AFTER collectives followed it (a 5-round record had one collective between the last
    change and the end of its series, which said nothing about the goal's three)."""
    ad = sorted((r for r in run["records"] if r["method"] == "adaptive" and r["phase"] == "measure"),
                key=lambda r: r["start"])
    out = []
    for i, ch in enumerate(run["changes"]):
        until = run["changes"][i + 1]["time"] if i + 1 < len(run["changes"]) else float("inf")
        before = [r for r in ad if r["start"] < ch["time"] and not r.get("probe")]
        after = [r for r in ad if r["start"] + r["seconds"] > ch["time"] and r["start"] < until]
        if not before or not after:
            continue
        old, n = before[-1]["plan"], None
        for k, r in enumerate(after):
            if r["plan"] != old and not r.get("probe"):
                n = k
                break
        if n is None and i + 1 == len(run["changes"]) and len(after) < JUDGED_AFTER:
            continue
        out.append(n)
    return out


def result(runs: dict, *, world: int, fast: float, slow: float, rounds: int, period: float) -> dict:
    rows = rows_of({sc: run for sc, run in runs.items() if sc != "changing"})
    congested = tuple(sc for sc in CONGESTED if sc in runs)
    vs_static = _ratios(rows, congested, "static", "adaptive")
    vs_gloo = _ratios(rows, congested, "gloo", "adaptive")
    unc = _ratios(rows, ("none",), "adaptive", "gloo")
    bound = add_model(rows, world=world, fast=fast, slow=slow)
    unc_ci = figure_ci(rows, ("none",), "adaptive", "gloo")
    cpu = _ratios(rows, ("none",), "adaptive", "gloo", key="median_cpu_s")
    res = {"world_size": world, "fast_mbit": fast, "slow_mbit": slow, "rounds": rounds, "warmup": WARMUP,
           "warmup_each": WARMUP_EACH, "methods": list(METHODS),
           "scenarios": list(runs), "rows": rows,
           "speedup_vs_static_congested": statistics.median(vs_static) if vs_static else None,
           "speedup_vs_gloo_congested": statistics.median(vs_gloo) if vs_gloo else None,
           "slowdown_vs_gloo_uncongested": statistics.median(unc) - 1 if unc else None,
           "speedup_vs_static_congested_ci95": figure_ci(rows, congested, "static", "adaptive"),
           "speedup_vs_gloo_congested_ci95": figure_ci(rows, congested, "gloo", "adaptive"),
           "slowdown_vs_gloo_uncongested_ci95": [x - 1 for x in unc_ci] if unc_ci else None,
           "model_speedup_vs_static_congested": statistics.median(bound) if bound else None,
           "cpu_vs_gloo_uncongested": statistics.median(cpu) if cpu else None,
           "goal": {"speedup_vs_static_congested": 1.4, "speedup_vs_gloo_congested": 1.2,
                    "slowdown_vs_gloo_uncongested": 0.05, "replan_collectives": 3},
           "bitwise_equal": _bitwise(runs),
           "warmup_events": {sc: [e for r in run["records"] if r["phase"] == "warmup" for e in r.get("events", [])]
                             for sc, run in runs.items()}}
    if "changing" in runs:
        counts = replan_counts(runs["changing"])
        seen = [c for c in counts if c is not None]
        res["replan_collectives"] = max(seen) if seen and len(seen) == len(counts) else None
        res["replan_collectives_per_change"] = counts
        res["changing"] = {"period_s": period, "changes": runs["changing"]["changes"],
                           "series": [{k: r[k] for k in ("method", "start", "seconds", "bytes")} | (
                               {"plan": r["plan"], "probe": r.get("probe")} if "plan" in r else {})
                               for r in runs["changing"]["records"] if r["phase"] == "measure"]}
    return res


def _bitwise(runs: dict) -> bool:
    """Static and adaptive gave the same bits on every payload and round (the reference's rule)."""
    for run in runs.values():
        by: dict = {}
        for r in run["records"]:
            if r["method"] in ("static", "adaptive"):
                by.setdefault((r["phase"], r["round"], r["bytes"]), set()).add(r["sha"])
        if any(len(v) != 1 for v in by.values()):
            return False
    return True


def kept_sections(path: Path) -> dict:
    """What `--only e2e` (bench/collectives_e2e.py) wrote into collectives.json, kept on rewrite."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    return {k: old[k] for k in ("e2e",) if k in old}


def table(res: dict) -> Table:
    t = Table(title=f"all-reduce algbw (GB/s), {res['world_size']} ranks, links {res['fast_mbit']:g} Mbit/s "
                    f"(slow {res['slow_mbit']:g})", caption=_figures_line(res))
    for col in ("scenario", "payload MB", *METHODS, "adaptive / static", "adaptive / gloo", "static eff.",
                "adaptive eff."):
        t.add_column(col)
    by = {(r["scenario"], r["bytes"], r["method"]): r for r in res["rows"]}
    for sc, b in dict.fromkeys((r["scenario"], r["bytes"]) for r in res["rows"]):
        bw = {m: by[(sc, b, m)]["algbw_GBps"] for m in METHODS if (sc, b, m) in by}
        eff = [by.get((sc, b, m), {}).get("efficiency") for m in ("static", "adaptive")]
        t.add_row(sc, f"{b / MB:g}", *(f"{bw[m]:.3f}" if m in bw else "-" for m in METHODS),
                  f"{bw['adaptive'] / bw['static']:.2f}x", f"{bw['adaptive'] / bw['gloo']:.2f}x",
                  *(f"{e:.0%}" if e is not None else "-" for e in eff))
    return t


def _figures_line(res: dict) -> str:
    """The three time figures with their 95 % intervals, for the table's caption."""
    out = []
    for key in ("speedup_vs_static_congested", "speedup_vs_gloo_congested", "slowdown_vs_gloo_uncongested"):
        v, ci = res.get(key), res.get(f"{key}_ci95")
        if v is not None:
            out.append(f"{key} {v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
    return "; ".join(out)


def plot(res: dict, path: Path) -> None:
    from unbroken.figures import plt, save_png

    scs = [sc for sc in res["scenarios"] if sc != "changing"]
    ncol = len(scs) + ("changing" in res)
    fig, axes = plt.subplots(1, ncol, figsize=(4.2 * ncol, 3.8), dpi=110, squeeze=False)
    try:
        for ax, sc in zip(axes[0], scs):
            for m in METHODS:
                pts = sorted((r["bytes"] / MB, r["algbw_GBps"]) for r in res["rows"] if r["scenario"] == sc
                             and r["method"] == m)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            ax.set_xscale("log", base=2), ax.set_title(sc), ax.set_xlabel("payload (MB)")
            ax.set_ylabel("algbw (GB/s)"), ax.legend(fontsize=8)
        if "changing" in res:
            _plot_series(axes[0][-1], res["changing"])
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)


def _plot_series(ax, ch: dict) -> None:
    t0 = min(r["start"] for r in ch["series"])
    for m in METHODS:
        pts = [(r["start"] - t0, r["bytes"] / r["seconds"] / 1e9) for r in ch["series"] if r["method"] == m]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=m)
    for c in ch["changes"]:
        ax.axvline(c["time"] - t0, color="grey", ls=":", lw=1)
    ad = [r for r in ch["series"] if r["method"] == "adaptive"]
    for prev, r in zip(ad, ad[1:]):
        if r["plan"] != prev["plan"]:
            ax.axvline(r["start"] - t0, color="red", ls="--", lw=0.8)
    ax.set_title("changing rate (grey: tc change, red: re-plan)", fontsize=9)
    ax.set_xlabel("time (s)"), ax.set_ylabel("algbw (GB/s)"), ax.legend(fontsize=8)
