"""A measured wiring: per-pair latency and bandwidth, and collective sweeps; how long a collective takes.

Written by `plan.probe` (format `unbroken-topology/1`), checked field by field on load. A
collective's time at n bytes comes from its sweep (piecewise linear between measured
sizes, the last segment's slope past the largest); without a sweep, from the alpha-beta
formulas over the ring's slowest pair: all-reduce 2(p-1)a + 2(p-1)/p n b, reduce-scatter
and all-gather half that, broadcast (p-1)a + n b... as a ring pipeline (n b + (p-1) a).
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from unbroken.fsutil import atomic_write_json
from unbroken.provenance import git_commit

FORMAT = "unbroken-topology/1"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


class TopologyError(ValueError):
    """A topology file that cannot be used (the message says why and how to get a good one)."""


_REMEASURE = "measure it again with `unbroken plan --measure-topology FILE --world-size N`"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    world: int
    latency_s: list[list[float]]
    bandwidth_Bps: list[list[float]]
    sweeps: dict[str, list[list[float]]]
    label: str = ""

    def __post_init__(self) -> None:
        _need(isinstance(self.world, int) and self.world >= 1, f"world must be an integer >= 1, got {self.world!r}")
        for name in ("latency_s", "bandwidth_Bps"):
            m = getattr(self, name)
            _need(isinstance(m, list) and len(m) == self.world and all(isinstance(r, list) and len(r) == self.world
                                                                         for r in m),
                  f"{name} must be a {self.world}x{self.world} matrix")
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    _need(_finite(v) and v >= 0, f"{name}[{i}][{j}] = {v!r} must be a number >= 0")
                    _need(i == j or name != "bandwidth_Bps" or v > 0, f"bandwidth_Bps[{i}][{j}] must be > 0")
        _need(isinstance(self.sweeps, dict), "sweeps must map a collective to [[bytes, seconds], ...]")
        for name, rows in self.sweeps.items():
            _need(name in COLLECTIVES, f"sweeps has unknown collective {name!r} (known: {', '.join(COLLECTIVES)})")
            _need(isinstance(rows, list) and all(isinstance(r, list) and len(r) in (2, 3) and _finite(r[0])
                                                 and r[0] > 0 and _finite(r[1]) and r[1] >= 0
                                                 and (len(r) == 2 or (_finite(r[2]) and 0 <= r[2] <= 1))
                                                 for r in rows),
                  f"sweeps.{name} must be [[bytes > 0, seconds >= 0(, cpu_block in [0, 1])], ...]")
            _need([r[0] for r in rows] == sorted({r[0] for r in rows}), f"sweeps.{name}: sizes must increase")

    # --- the formulas ----------------------------------------------------------------------
    def ring_alpha_beta(self) -> tuple[float, float]:
        """(alpha seconds, beta seconds per byte) of the ring's slowest hop (rank i -> i+1)."""
        p = self.world
        if p == 1:
            return 0.0, 0.0
        hops = [(i, (i + 1) % p) for i in range(p)]
        alpha = max(self.latency_s[i][j] for i, j in hops)
        beta = max(1.0 / self.bandwidth_Bps[i][j] for i, j in hops)
        return alpha, beta

    def formula_seconds(self, collective: str, nbytes: float) -> float:
        p = self.world
        if p == 1:
            return 0.0
        a, b = self.ring_alpha_beta()
        full = 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * b
        return {"all_reduce": full, "reduce_scatter": full / 2, "all_gather": full / 2,
                "broadcast": (p - 1) * a + nbytes * b}[collective]

    # --- what the planner asks -------------------------------------------------------------
    def seconds(self, collective: str, nbytes: float) -> float:
        """Predicted seconds of one `collective` over the whole group on an nbytes tensor."""
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}")
        if self.world == 1 or nbytes <= 0:
            return 0.0
        rows = self.sweeps.get(collective) or []
        if len(rows) < 2:
            return self.formula_seconds(collective, nbytes)
        return _interpolate(rows, nbytes)

    def cpu_block(self, collective: str, nbytes: float) -> float:
        """The share of the collective's time its CPU work takes from a rank's compute (plan.probe's
        third sweep column; 0 where the sweep has none: a topology measured before it existed)."""
        rows = [r for r in self.sweeps.get(collective) or [] if len(r) == 3]
        if self.world == 1 or nbytes <= 0 or not rows:
            return 0.0
        return min(1.0, _interpolate(rows, nbytes, column=2))

    # --- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "world": self.world, "label": self.label, "latency_s": self.latency_s,
                "bandwidth_Bps": self.bandwidth_Bps, "sweeps": self.sweeps, **git_commit()}

    def save(self, path: Path) -> Path:
        atomic_write_json(Path(path), self.to_dict())
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "Topology":
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TopologyError(f"no topology file {path}; {_REMEASURE}") from None
        except (OSError, ValueError) as e:
            raise TopologyError(f"{path} is not a readable JSON file ({e}); {_REMEASURE}") from None
        return cls.from_dict(doc, origin=str(path))

    @classmethod
    def from_dict(cls, doc: Any, origin: str = "topology") -> "Topology":
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise TopologyError(f"{origin} is not a {FORMAT} file (format {found!r}); {_REMEASURE}")
        try:
            return cls(world=doc.get("world"), latency_s=doc.get("latency_s"), bandwidth_Bps=doc.get("bandwidth_Bps"),
                       sweeps=doc.get("sweeps", {}), label=str(doc.get("label", "")))
        except TopologyError as e:
            raise TopologyError(f"{origin}: {e}; {_REMEASURE}") from None


def loopback_formula(world: int, *, alpha_s: float = 50e-6, bandwidth_Bps: float = 1e9) -> Topology:
    """A topology without measurements (uniform alpha, beta): for tests and rough plans."""
    lat = [[0.0 if i == j else alpha_s for j in range(world)] for i in range(world)]
    bw = [[0.0 if i == j else bandwidth_Bps for j in range(world)] for i in range(world)]
    return Topology(world=world, latency_s=lat, bandwidth_Bps=bw, sweeps={}, label="formula")


def _interpolate(rows: list[list[float]], x: float, column: int = 1) -> float:
    """Piecewise linear through the measured points (bytes, rows' `column`); below the smallest,
    its value (latency bound); past the largest, the last segment's line."""
    xs = [r[0] for r in rows]
    if x <= xs[0]:
        return rows[0][column]
    i = min(bisect.bisect_left(xs, x), len(rows) - 1)
    x0, y0, x1, y1 = rows[i - 1][0], rows[i - 1][column], rows[i][0], rows[i][column]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise TopologyError(msg)
