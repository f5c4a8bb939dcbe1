"""Non-IID split of a training set across logical clients: Dirichlet label skew (α) over
clients whose sizes are log-normally skewed (σ). Deterministic in the seed."""
from __future__ import annotations

import numpy as np

from unbroken.split.errors import SplitInputError


def partition(labels: np.ndarray, n_clients: int, *, alpha: float, size_sigma: float, seed: int) -> list[np.ndarray]:
    """Sample indices per client. Class k's samples go to client i with weight Dir(α)_i · s_i,
    s_i ~ LogNormal(0, σ): small α = few classes per client, large σ = very unequal sizes.
    Every client holds at least one sample."""
    labels = np.asarray(labels)
    if n_clients < 1:
        raise SplitInputError(f"--clients must be >= 1, got {n_clients}")
    if n_clients > len(labels):
        raise SplitInputError(f"{n_clients} clients but only {len(labels)} training samples; use --clients "
                              f"<= {len(labels)}")
    if not alpha > 0:
        raise SplitInputError(f"--alpha (Dirichlet label skew) must be > 0, got {alpha}")
    if size_sigma < 0:
        raise SplitInputError(f"--size-sigma must be >= 0, got {size_sigma}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(0.0, size_sigma, n_clients) if size_sigma > 0 else np.ones(n_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for k in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == k))
        w = rng.dirichlet(np.full(n_clients, alpha)) * sizes
        cuts = np.round(np.cumsum(w / w.sum()) * len(idx)).astype(int)[:-1]
        for i, piece in enumerate(np.split(idx, cuts)):
            parts[i].append(piece)
    clients = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    _fill_empty(clients)
    return clients


def _fill_empty(clients: list[np.ndarray]) -> None:
    """Give an empty client one sample of the largest client (a client exists because it holds data)."""
    for i, c in enumerate(clients):
        if len(c) == 0:
            j = max(range(len(clients)), key=lambda m: len(clients[m]))
            clients[i], clients[j] = clients[j][-1:], clients[j][:-1]


def owners(clients: list[np.ndarray], n_samples: int) -> np.ndarray:
    """owner[s] = the client holding sample s."""
    own = np.full(n_samples, -1, dtype=np.int64)
    for i, c in enumerate(clients):
        own[c] = i
    return own


def class_counts(labels: np.ndarray, clients: list[np.ndarray], n_classes: int) -> np.ndarray:
    """counts[i, k] = samples of class k held by client i."""
    return np.stack([np.bincount(labels[c], minlength=n_classes) for c in clients])
