"""unbroken's failure-free overhead as measured by the overhead benchmark (bench/results/overhead.json).

The file (written by `unbroken bench overhead`) holds `ratio[strategy][world]`, unbroken's
tokens/s over its native PyTorch peer's, `ci95[strategy][world]` = [lo, hi] of that ratio,
and `protect_every`, `rounds`, `commit` (and `dirty`). A step then takes 1/ratio times as
long as native, so the overhead is 1/ratio - 1, taken for DEFAULT_STRATEGY at the largest
measured world size and clamped at 0 (a ratio above 1 is noise in unbroken's favour, not
a negative cost). An overhead of 1 or more (ratio <= 0.5) is outside the model and rejected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from unbroken.sim.errors import SimError, need
from unbroken.sim.policies import check_overhead

DEFAULT_STRATEGY = "zero1"
OVERHEAD_FILE = "overhead.json"
_FIX = "rerun `unbroken bench overhead` or pass --overhead F"


def overhead_fraction(ratio: float) -> float:
    """Time per step relative to native, from the tokens/s ratio: max(0, 1/ratio - 1)."""
    return max(0.0, 1.0 / ratio - 1.0)


@dataclass(frozen=True, kw_only=True)
class OverheadCalibration:
    """unbroken's measured failure-free overhead and where it came from."""

    source: str
    strategy: str
    world: int
    ratio: float
    overhead: float
    ratio_ci95: tuple[float, float] | None = None
    protect_every: Any = None
    rounds: Any = None
    commit: Any = None
    dirty: Any = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_overhead(f"{self.source}: the overhead 1/ratio - 1", self.overhead)

    @property
    def overhead_ci95(self) -> tuple[float, float] | None:
        """The ratio's interval turned into one of the overhead (a high ratio is a low overhead)."""
        if self.ratio_ci95 is None:
            return None
        lo, hi = self.ratio_ci95
        return overhead_fraction(hi), overhead_fraction(lo)

    def provenance(self) -> dict[str, Any]:
        """What the simulator's output JSON records about this overhead."""
        ci = self.overhead_ci95
        return {"kind": "calibrated", "file": self.source, "commit": self.commit, "dirty": self.dirty,
                "strategy": self.strategy, "world": self.world, "ratio": self.ratio,
                "ratio_ci95": None if self.ratio_ci95 is None else list(self.ratio_ci95),
                "overhead_ci95": None if ci is None else [round(ci[0], 6), round(ci[1], 6)],
                "protect_every": self.protect_every, "rounds": self.rounds}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _per_world(d: dict[str, Any], key: str, strategy: str, origin: str) -> dict[int, Any]:
    """d[key][strategy] as {world size: value}; the world keys are integers (as JSON strings)."""
    table = d.get(key)
    need(isinstance(table, dict), f"{origin}: {key!r} must map strategy -> {{world size: value}}, "
         f"got {table!r}; {_FIX}")
    need(strategy in table, f"{origin}: no {key} for strategy {strategy!r} (has: "
         f"{', '.join(map(str, table)) or 'none'}); {_FIX}")
    row = table[strategy]
    need(isinstance(row, dict) and bool(row), f"{origin}: {key}.{strategy} must map world size -> value, "
         f"got {row!r}; {_FIX}")
    out: dict[int, Any] = {}
    for w, v in row.items():
        try:
            n = int(w)
        except (TypeError, ValueError):
            raise SimError(f"{origin}: {key}.{strategy} has world size {w!r}, not an integer; {_FIX}") from None
        need(n >= 1, f"{origin}: {key}.{strategy} has world size {n}, must be >= 1; {_FIX}")
        out[n] = v
    return out


def _ci(d: dict[str, Any], strategy: str, world: int, origin: str, notes: list[str]) -> tuple[float, float] | None:
    if "ci95" not in d:
        notes.append("no ci95: the overhead is reported without an interval")
        return None
    rows = _per_world(d, "ci95", strategy, origin)
    ci = rows.get(world)
    if ci is None:
        notes.append(f"no ci95.{strategy}.{world}: the overhead is reported without an interval")
        return None
    ok = isinstance(ci, list) and len(ci) == 2 and all(_number(x) and x > 0 for x in ci) and ci[0] <= ci[1]
    need(ok, f"{origin}: ci95.{strategy}.{world} must be [lo, hi] with 0 < lo <= hi, got {ci!r}; {_FIX}")
    return float(ci[0]), float(ci[1])


def overhead_from_dict(d: Any, origin: str, strategy: str = DEFAULT_STRATEGY) -> OverheadCalibration:
    """Validate the overhead benchmark's JSON and take `strategy` at its largest world size."""
    need(isinstance(d, dict), f"{origin}: expected a JSON object with 'ratio' per strategy and world size, "
         f"got {type(d).__name__}; {_FIX}")
    rows = _per_world(d, "ratio", strategy, origin)
    world = max(rows)
    ratio = rows[world]
    need(_number(ratio) and ratio > 0, f"{origin}: ratio.{strategy}.{world} must be a number > 0 "
         f"(unbroken tokens/s / native tokens/s), got {ratio!r}; {_FIX}")
    o = overhead_fraction(float(ratio))
    need(o < 1, f"{origin}: ratio.{strategy}.{world} = {ratio!r} means an overhead of {o:.3g} "
         f"(1/ratio - 1), outside the [0, 1) the simulator models; {_FIX}")
    notes: list[str] = []
    ci = _ci(d, strategy, world, origin, notes)
    for key in ("protect_every", "rounds", "commit"):
        if key not in d:
            notes.append(f"no {key!r} in the overhead file: recorded as null")
    if ratio > 1:
        notes.append(f"ratio.{strategy}.{world} = {ratio:g} > 1 (faster than native): overhead clamped at 0")
    return OverheadCalibration(source=origin, strategy=strategy, world=world, ratio=float(ratio), overhead=o,
                               ratio_ci95=ci, protect_every=d.get("protect_every"), rounds=d.get("rounds"),
                               commit=d.get("commit"), dirty=d.get("dirty"), notes=tuple(notes))
