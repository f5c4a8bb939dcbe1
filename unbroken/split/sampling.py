"""Who sends which samples at each step: the server's global sampling (GPSL: the batch's
class mix matches the pooled mix of the present clients; per-client batch sizes follow;
without replacement within an epoch), PSL's fixed per-client batches, and dropouts."""
from __future__ import annotations

import numpy as np

from unbroken.split.errors import SplitInputError

_DROP, _CLASS, _CLIENT = 1, 2, 3  # RNG stream tags: draws are functions of (seed, tag, ids), never of history


def present_clients(seed: int, round_: int, n_clients: int, p_drop: float) -> np.ndarray:
    """present[i]: client i takes part in round `round_` (each drops out with probability p_drop)."""
    if p_drop <= 0:
        return np.ones(n_clients, dtype=bool)
    return np.random.default_rng([seed, _DROP, round_]).random(n_clients) >= p_drop


def quotas(class_counts: np.ndarray, batch: int) -> np.ndarray:
    """Samples per class in a batch of `batch`: proportional to `class_counts`, largest remainder."""
    total = class_counts.sum()
    if total == 0:
        return np.zeros_like(class_counts)
    exact = class_counts * (batch / total)
    q = np.floor(exact).astype(np.int64)
    q = np.minimum(q, class_counts)
    short = min(batch, int(total)) - int(q.sum())
    if short > 0:
        room = np.flatnonzero(q < class_counts)
        order = room[np.argsort(-(exact[room] - q[room]), kind="stable")]
        q[order[:short]] += 1
    return q


class _Cycle:
    """One index pool visited in seeded permutations, epoch after epoch (without replacement)."""

    def __init__(self, pool: np.ndarray, seed: list[int]) -> None:
        self.pool, self.seed, self.epoch, self.pos = pool, seed, 0, 0
        self.order = self._perm()

    def _perm(self) -> np.ndarray:
        return self.pool[np.random.default_rng([*self.seed, self.epoch]).permutation(len(self.pool))]

    def take(self, n: int, keep: np.ndarray | None = None) -> np.ndarray:
        """The next n indices for which keep[index] holds (passed-over ones are consumed)."""
        out: list[np.ndarray] = []
        got, scanned = 0, 0
        while got < n and len(self.pool) and scanned <= 2 * len(self.pool):
            if self.pos == len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self._perm()
            chunk = self.order[self.pos:self.pos + (n - got)]
            self.pos += len(chunk)
            scanned += len(chunk)
            if keep is not None:
                chunk = chunk[keep[chunk]]
            out.append(chunk)
            got += len(chunk)
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


class GlobalSampler:
    """GPSL's server-side sampling over one group of clients (all clients, or one cluster)."""

    def __init__(self, labels: np.ndarray, owner: np.ndarray, clients: np.ndarray, n_classes: int, batch: int,
                 seed: int, stream: int) -> None:
        if batch < n_classes:
            raise SplitInputError(f"batch size {batch} is smaller than the {n_classes} classes: global sampling "
                                  f"cannot match the class mix; use --batch >= {n_classes}")
        self.labels, self.owner, self.batch, self.n_classes = labels, owner, batch, n_classes
        mine = np.flatnonzero(np.isin(owner, clients))
        self.cycles = [_Cycle(mine[labels[mine] == k], [seed, _CLASS, stream, k]) for k in range(n_classes)]

    def next(self, present: np.ndarray) -> np.ndarray:
        """One batch from the present clients' samples, class mix = their pooled class mix."""
        keep = present[self.owner]
        counts = np.array([int(keep[c.pool].sum()) for c in self.cycles], dtype=np.int64)
        q = quotas(counts, self.batch)
        return np.concatenate([c.take(int(n), keep) for c, n in zip(self.cycles, q) if n])


class ClientCycles:
    """Each client's own data in seeded permutations (PSL's and the serialized baseline's batches)."""

    def __init__(self, clients: list[np.ndarray], seed: int) -> None:
        self.cycles = [_Cycle(c, [seed, _CLIENT, i]) for i, c in enumerate(clients)]

    def take(self, client: int, n: int) -> np.ndarray:
        return self.cycles[client].take(n)

    def epoch_of(self, client: int) -> int:
        return self.cycles[client].epoch
