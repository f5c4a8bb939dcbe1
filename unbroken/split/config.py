"""The split-learning job's configuration: a frozen dataclass validated at construction."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from unbroken.split.errors import SplitInputError

METHODS = ("serialized", "psl", "gpsl", "gcpsl-random", "gcpsl-size", "gcpsl-label")
DATASETS = ("fashion-mnist", "cifar10", "digits")


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """dataset/data_dir: what to train on; clients, alpha (Dirichlet label skew), size_sigma
    (log-normal size skew): the non-IID split; clusters, merge_every (local steps between
    merges), batch (global-sampling batch per worker step): GPSL/GCPSL; psl_client_batch,
    serial_batch: per-client batches of PSL and of the serialized baseline; epochs: the
    sample budget (epochs x training set) of every method; p_drop: a client's chance to drop
    out of a round."""
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    clients: int = 256
    alpha: float = 0.5
    size_sigma: float = 1.0
    clusters: int = 4
    merge_every: int = 32
    batch: int = 64
    psl_client_batch: int = 1
    serial_batch: int = 16
    epochs: float = 2.0
    lr: float = 0.02
    momentum: float = 0.9
    hidden: int = 128
    p_drop: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise SplitInputError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        for name in ("clients", "clusters", "merge_every", "batch", "psl_client_batch", "serial_batch", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SplitInputError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.clusters > self.clients:
            raise SplitInputError(f"{self.clusters} clusters for {self.clients} clients: every cluster needs a "
                                  f"client; use --clusters <= {self.clients}")
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise SplitInputError(f"--epochs must be > 0, got {self.epochs}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SplitInputError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise SplitInputError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.p_drop < 1:
            raise SplitInputError(f"--p-drop must be in [0, 1), got {self.p_drop}")

    @property
    def samples_per_round(self) -> int:
        """A round is one merge period of GCPSL; every method is evaluated after as many samples."""
        return self.clusters * self.merge_every * self.batch

    def rounds(self, n_train: int) -> int:
        return max(1, math.ceil(self.epochs * n_train / self.samples_per_round))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SplitConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SplitInputError(f"unknown split setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**d)
