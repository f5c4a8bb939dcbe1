"""`unbroken bench regroup`: how the regroup phase grows with the number of ranks, and its fit.

For each world size (4 ... 64 on this host: oversubscribed, a tiny model) one rank is
SIGKILLed at step 3 and the `regroup` phase of its recovery is read from the `recovered`
event (new generation published -> the new process group ready on every member). Two models
are fitted by least squares, `a + b*log2(N)` and `a + b*N`; the one with the smaller residual
is reported, with both. The fit goes into `bench/results/multinode.json` (`regroup_fit`),
where `unbroken simulate --calibrate` reads it as the regroup term of the unbroken policy.
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path

import numpy as np
from rich.table import Table

from unbroken.bench.common import run_job
from unbroken.config import ModelConfig, RunConfig
from unbroken.fsutil import atomic_write_json
from unbroken.provenance import git_commit
from unbroken.runtime.faults import FaultSpec

SIZES = (4, 8, 16, 32, 64)
MODELS = {"log2": lambda n: math.log2(n), "linear": lambda n: float(n)}


def job(world: int) -> RunConfig:
    """Tiny model; detection generous (60 s silence = hang): dozens of processes starting on two cores
    are slow to beat, and what is measured is the regroup after a real kill, not detection."""
    return RunConfig(world_size=world, steps=6, batch_size=2, checkpoint_every=0, shadows=1, hang_timeout_s=60.0,
                     model=ModelConfig(n_layer=1, n_head=2, n_embd=32, seq_len=32))


def regroup_s(summary: dict) -> float:
    """The one recovery's regroup phase (runtime/breakdown.py: generation published -> group ready)."""
    [rec] = summary["recoveries"]
    if not rec.get("complete"):
        raise RuntimeError(f"the recovery of {summary['world_size']} ranks has no complete breakdown: {rec}")
    return float(rec["regroup_s"])


def measure(*, sizes: tuple[int, ...] = SIZES, rounds: int = 2, log=print) -> dict:
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for n in sizes:
                log(f"{n} ranks, round {r + 1}/{rounds}")
                run_dir = Path(tmp) / f"n{n}-r{r}"
                kill = FaultSpec.parse(f"sigkill:rank={n - 1},step=3,phase=forward")
                summary = run_job(job(n), run_dir, faults=(kill,))
                if not summary.get("ok"):
                    raise RuntimeError(f"the {n}-rank run did not finish cleanly: see {run_dir}")
                points.append({"ranks": n, "regroup_s": regroup_s(summary), "recovery_s": summary["recoveries"][0]["recovery_s"]})
    return {"sizes": list(sizes), "rounds": rounds, **fit(points)}


def fit(points: list[dict]) -> dict:
    """Least squares of regroup_s on each model's feature; the better one (smaller residual) is `model`."""
    n = np.array([p["ranks"] for p in points], dtype=float)
    y = np.array([p["regroup_s"] for p in points])
    fits = {}
    for name, f in MODELS.items():
        x = np.array([f(v) for v in n])
        a_mat = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
        rss = float(np.sum((a_mat @ np.array([a, b]) - y) ** 2))
        fits[name] = {"a_s": float(a), "b_s": float(b), "rss": rss,
                      "r2": 1 - rss / float(np.sum((y - y.mean()) ** 2)) if len(y) > 1 and y.std() > 0 else None}
    best = min(fits, key=lambda k: fits[k]["rss"])
    medians = {int(k): statistics.median(p["regroup_s"] for p in points if p["ranks"] == k) for k in set(n.astype(int))}
    return {"model": best, "constants": {"a_s": fits[best]["a_s"], "b_s": fits[best]["b_s"]}, "fits": fits,
            "points": points, "median_by_ranks": {str(k): v for k, v in sorted(medians.items())}}


def write_into_multinode(res: dict, path: Path) -> None:
    """multinode.json's `regroup_fit`, the rest of the file kept (its own commit stays with it)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["regroup_fit"] = {**res, **git_commit()}
    atomic_write_json(path, data)


def table(res: dict) -> Table:
    t = Table(title=f"regroup vs ranks ({res['rounds']} rounds): best fit {res['model']}")
    for col in ("ranks", "regroup s (median)"):
        t.add_column(col)
    for k, v in res["median_by_ranks"].items():
        t.add_row(k, f"{v:.3f}")
    f = res["fits"]
    t.caption = "; ".join(f"{m}: {x['a_s']:.3f} + {x['b_s']:.4f}*{'log2 N' if m == 'log2' else 'N'} "
                          f"(R^2 {x['r2']:.2f})" for m, x in f.items() if x["r2"] is not None)
    return t
