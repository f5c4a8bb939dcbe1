"""The regroup term fitted by `unbroken bench regroup` (multinode.json's `regroup_fit`), for the simulator.

The bench fits regroup seconds against ranks N as `a + b*log2(N)` or `a + b*N` (whichever has
the smaller residual). `--calibrate bench/results/multinode.json` (the file named: a results
directory does not opt in, because a fit made of processes sharing two cores is a property of
that host, not of a cluster) replaces unbroken's regroup phase by the fitted curve, evaluated
at the simulated GPU count (floored at 0 s).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from unbroken.sim.errors import need

MULTINODE_FILE = "multinode.json"
MODELS = ("log2", "linear")


@dataclass(frozen=True, kw_only=True)
class RegroupFit:
    model: str
    a_s: float
    b_s: float
    source: str
    commit: str | None = None

    def __post_init__(self) -> None:
        need(self.model in MODELS, f"{self.source}: regroup_fit.model must be one of {', '.join(MODELS)}, "
             f"got {self.model!r}; rerun `unbroken bench regroup`")
        need(self.b_s >= 0, f"{self.source}: regroup_fit b_s must be >= 0 (regroup never gets faster with more "
             f"ranks), got {self.b_s!r}; rerun `unbroken bench regroup` with more sizes or rounds")

    def policy_fields(self) -> dict[str, float]:
        """Unbroken's regroup parameters (sim/policies.py) for this fit."""
        return {"regroup_base_s": self.a_s, "regroup_per_log2_s": self.b_s if self.model == "log2" else 0.0,
                "regroup_per_rank_s": self.b_s if self.model == "linear" else 0.0}


def regroup_fit_from_dict(d: Any, origin: str) -> RegroupFit:
    need(isinstance(d, dict) and isinstance(d.get("regroup_fit"), dict),
         f"{origin}: no 'regroup_fit' object; run `unbroken bench regroup` to add it")
    f = d["regroup_fit"]
    c = f.get("constants")
    need(isinstance(c, dict) and all(isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool)
                                     for k in ("a_s", "b_s")),
         f"{origin}: regroup_fit.constants must hold numbers a_s and b_s, got {c!r}")
    return RegroupFit(model=f.get("model"), a_s=float(c["a_s"]), b_s=float(c["b_s"]), source=origin,
                      commit=f.get("commit"))


def apply_regroup_fit(policy, fit: RegroupFit):
    """The unbroken policy with the fitted regroup term (other policies unchanged)."""
    return dataclasses.replace(policy, **fit.policy_fields())
