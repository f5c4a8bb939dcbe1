"""Measurements joined with the spec tables: the arrays every model, baseline and split works on."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unbroken.predict.features import FEATURES, bandwidth_latency_s, compute_latency_s, matrix, point_of
from unbroken.predict.measurements import Measurement
from unbroken.predict.tables import GpuTable, ModelTable


@dataclass(frozen=True)
class Table:
    rows: tuple[Measurement, ...]
    X: np.ndarray            # features (n, len(FEATURES))
    tdp_w: np.ndarray        # per-GPU TDP (W), NaN where unknown
    power_w: np.ndarray      # measured power per GPU (W), NaN where not measured
    itl_s: np.ndarray
    roofline_s: np.ndarray   # max(bandwidth latency, compute latency), NaN where neither is known
    gpu: np.ndarray          # group labels: the spec table's name, whatever alias the measurement used
    model: np.ndarray        # group labels (as the data set names them)
    maker: np.ndarray        # the GPU's manufacturer ("" where the spec row names none)

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, idx: np.ndarray) -> "Table":
        return Table(rows=tuple(self.rows[i] for i in idx), X=self.X[idx], tdp_w=self.tdp_w[idx],
                     power_w=self.power_w[idx], itl_s=self.itl_s[idx], roofline_s=self.roofline_s[idx],
                     gpu=self.gpu[idx], model=self.model[idx], maker=self.maker[idx])

    def category(self) -> np.ndarray:
        """Mondrian conformal categories: the scenario code (single / offline / server)."""
        return self.X[:, FEATURES.index("scenario")]

    def target(self, name: str) -> np.ndarray:
        """What the regressors fit for `name`: power per GPU / TDP, or ITL seconds."""
        return self.power_w / self.tdp_w if name == "power" else self.itl_s

    def with_target(self, name: str) -> "Table":
        """Only the rows where `name` was measured (and, for power, the TDP is known)."""
        y = self.target(name)
        return self.subset(np.flatnonzero(np.isfinite(y) & (y > 0)))


def build(rows: list[Measurement], gpus: GpuTable, models: ModelTable) -> Table:
    """Join each measurement with its GPU's and model's specs (a missing spec is a SpecError)."""
    triples = [(gpus.get(m.gpu), models.get(m.model), point_of(m)) for m in rows]
    roof = [np.fmax(bandwidth_latency_s(g, s, op.n_gpus), compute_latency_s(g, s, op.n_gpus, op.batch))
            for g, s, op in triples]
    return Table(rows=tuple(rows), X=matrix(triples),
                 tdp_w=np.array([g.thermal_design_power_w for g, _, _ in triples], dtype=float),
                 power_w=np.array([m.power_w for m in rows], dtype=float),
                 itl_s=np.array([m.itl_s for m in rows], dtype=float),
                 roofline_s=np.array(roof, dtype=float),
                 gpu=np.array([g.name for g, _, _ in triples]), model=np.array([m.model for m in rows]),
                 maker=np.array([g.manufacturer for g, _, _ in triples]))
