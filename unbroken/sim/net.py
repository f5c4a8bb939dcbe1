"""Net ETTR across cluster sizes and the break-even overhead; the results document (--out).

Break-even overhead: the largest failure-free overhead at which unbroken's net ETTR still
reaches another policy's. `break_even_overhead` bisects any ETTR that decreases with the
overhead; `unbroken_break_even` feeds it fresh simulations of unbroken at trial overheads
on the same seeds (common random numbers), so it stays right if the model changes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from unbroken.fsutil import atomic_write_json
from unbroken.provenance import git_commit
from unbroken.sim.cluster import Cluster
from unbroken.sim.costs import Workload
from unbroken.sim.errors import SimError, need
from unbroken.sim.montecarlo import Summary, monte_carlo
from unbroken.sim.policies import Policy
from unbroken.sim.rates import FailureMix

MAX_OVERHEAD = 0.999  # overheads live in [0, 1)
TOL = 1e-4
OVERHEAD_GRID = (0.0, 0.02, 0.05, 0.10, 0.16)  # unbroken's net ETTR at these overheads, in the document


def break_even_overhead(ettr_at: Callable[[float], float], target: float, *, hi: float = MAX_OVERHEAD,
                        tol: float = TOL) -> float | None:
    """The largest o in [0, hi] with ettr_at(o) >= target (within tol), for ettr_at decreasing in o.

    None when even o = 0 falls short of target; hi when ettr_at(hi) still reaches it.
    """
    need(0 < hi < 1 and tol > 0, f"break-even search needs 0 < hi < 1 and tol > 0, got hi={hi}, tol={tol}")
    if ettr_at(0.0) < target:
        return None
    if ettr_at(hi) >= target:
        return hi
    lo = 0.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if ettr_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def unbroken_ettr_at(policy: Policy, cluster: Cluster, mix: FailureMix, workload: Workload, *,
                     seeds: int, seed: int) -> Callable[[float], float]:
    """o -> unbroken's mean net ETTR over the seeds with its overhead set to o."""
    def ettr(o: float) -> float:
        pol = dataclasses.replace(policy, overhead=o)
        return monte_carlo({"unbroken": pol}, cluster, mix, workload, seeds=seeds, seed=seed)[0].ettr
    return ettr


def break_even_row(summaries: list[Summary], ettr_at: Callable[[float], float]) -> dict[str, Any]:
    """unbroken's break-even overhead against ckpt-restart and against the best other simulated policy."""
    by = {s.policy: s for s in summaries}
    need("unbroken" in by and "ckpt-restart" in by,
         "--break-even compares unbroken with ckpt-restart; simulate both (e.g. --policy all)")
    best = max((s for s in summaries if s.policy != "unbroken"), key=lambda s: s.ettr)

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 5)

    vs_ckpt = break_even_overhead(ettr_at, by["ckpt-restart"].ettr)
    vs_best = vs_ckpt if best.policy == "ckpt-restart" else break_even_overhead(ettr_at, best.ettr)
    return {"vs_ckpt_restart": rounded(vs_ckpt), "best_other": best.policy, "vs_best_other": rounded(vs_best),
            "overhead": round(by["unbroken"].overhead, 6), "tol": TOL, "max": MAX_OVERHEAD}


def describe(gpus: int, be: Mapping[str, Any]) -> str:
    """One line: unbroken's break-even overheads at this size and whether its own overhead is below them."""
    o = be["overhead"]

    def part(x: float | None, other: str) -> str:
        if x is None:
            return f"none vs {other} (loses even at 0)"
        verdict = "gain exceeds cost" if o <= x else "cost exceeds gain"
        return f"{100 * x:.2f}% vs {other} ({verdict} at {100 * o:.1f}%)"

    line = f"break-even overhead of unbroken at {gpus:,} GPUs: {part(be['vs_ckpt_restart'], 'ckpt-restart')}"
    if be["best_other"] != "ckpt-restart":
        line += f"; {part(be['vs_best_other'], be['best_other'])}"
    return line


def overhead_grid(ettr_at: Callable[[float], float]) -> dict[str, float]:
    return {f"{o:g}": round(ettr_at(o), 6) for o in OVERHEAD_GRID}


def write_document(path: Path, doc: dict[str, Any]) -> None:
    """The results document, atomically, with the commit of the code that computed it."""
    try:
        atomic_write_json(path, {**doc, **git_commit()})
    except OSError as e:
        raise SimError(f"cannot write {str(path)!r}: {e.strerror or e}; pass --out with a writable path") from None
