"""Fixed clusters of clients: random (baseline), size-balanced (equal samples per cluster)
and label-aware (each cluster's class mix close to the pooled one, sizes kept balanced)."""
from __future__ import annotations

import numpy as np

from unbroken.split.errors import SplitInputError

METHODS = ("random", "size", "label")


def assign(counts: np.ndarray, n_clusters: int, method: str, seed: int) -> np.ndarray:
    """cluster[i] for client i, from the clients' class counts (clients x classes)."""
    n_clients = len(counts)
    if n_clusters < 1:
        raise SplitInputError(f"--clusters must be >= 1, got {n_clusters}")
    if n_clusters > n_clients:
        raise SplitInputError(f"{n_clusters} clusters for {n_clients} clients: every cluster needs a client; "
                              f"use --clusters <= {n_clients} or more --clients")
    if method == "random":
        order = np.random.default_rng(seed).permutation(n_clients)
        out = np.empty(n_clients, dtype=np.int64)
        out[order] = np.arange(n_clients) % n_clusters
    elif method == "size":
        out = _size_balanced(counts.sum(1), n_clusters)
    elif method == "label":
        out = _label_aware(counts, n_clusters)
    else:
        raise SplitInputError(f"unknown cluster assignment {method!r}; choose one of {', '.join(METHODS)}")
    return check(out, n_clusters)


def check(cluster_of: np.ndarray, n_clusters: int) -> np.ndarray:
    """Refuse an assignment with a cluster id out of range or a cluster without clients."""
    cluster_of = np.asarray(cluster_of, dtype=np.int64)
    bad = cluster_of[(cluster_of < 0) | (cluster_of >= n_clusters)]
    if len(bad):
        raise SplitInputError(f"cluster id {int(bad[0])} is out of range for {n_clusters} clusters; "
                              f"use ids 0..{n_clusters - 1}")
    empty = sorted(set(range(n_clusters)) - set(cluster_of.tolist()))
    if empty:
        raise SplitInputError(f"cluster {empty[0]} has no clients; assign at least one client to every "
                              "cluster or use fewer --clusters")
    return cluster_of


def _size_balanced(sizes: np.ndarray, n_clusters: int) -> np.ndarray:
    """Longest-processing-time greedy: biggest client first, into the cluster with the fewest samples."""
    out = np.empty(len(sizes), dtype=np.int64)
    load = np.zeros(n_clusters)
    for i in np.argsort(-sizes, kind="stable"):
        c = int(np.argmin(load))
        out[i], load[c] = c, load[c] + sizes[i]
    return out


def _label_aware(counts: np.ndarray, n_clusters: int, passes: int = 4) -> np.ndarray:
    """Every cluster aims at the same class counts, target = pooled counts / clusters (so both
    its class mix and its size match). Biggest client first, into the cluster whose distance
    (L1, in samples) to its target shrinks most; then moves of single clients while one
    shrinks the total distance. Starting with one client per cluster keeps none empty."""
    counts = counts.astype(np.float64)
    target = counts.sum(0) / n_clusters
    hist = np.zeros((n_clusters, counts.shape[1]))
    out = np.empty(len(counts), dtype=np.int64)
    for n_seen, i in enumerate(np.argsort(-counts.sum(1), kind="stable")):
        gain = np.abs(hist + counts[i] - target).sum(1) - np.abs(hist - target).sum(1)
        c = n_seen if n_seen < n_clusters else int(np.argmin(gain))
        out[i] = c
        hist[c] += counts[i]
    for _ in range(passes):
        moved = False
        for i in range(len(counts)):
            a = out[i]
            if (out == a).sum() == 1:
                continue
            before = np.abs(hist[a] - target).sum() + np.abs(hist - target).sum(1)
            after = np.abs(hist[a] - counts[i] - target).sum() + np.abs(hist + counts[i] - target).sum(1)
            delta = after - before
            delta[a] = 0.0
            b = int(np.argmin(delta))
            if delta[b] < -1e-9:
                out[i], moved = b, True
                hist[a] -= counts[i]
                hist[b] += counts[i]
        if not moved:
            break
    return out
