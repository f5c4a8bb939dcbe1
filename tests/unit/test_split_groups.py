"""Non-IID partition and cluster assignment: coverage, skew, balance, and bad input."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.split import clusters, partition
from unbroken.split.errors import SplitInputError

LABELS = np.random.default_rng(0).integers(0, 10, 3000)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 64), alpha=st.floats(0.05, 10), sigma=st.floats(0, 2), seed=st.integers(0, 99))
def test_partition_covers_every_sample_once(n, alpha, sigma, seed):
    parts = partition.partition(LABELS, n, alpha=alpha, size_sigma=sigma, seed=seed)
    assert len(parts) == n and all(len(p) for p in parts)
    allidx = np.concatenate(parts)
    assert np.array_equal(np.sort(allidx), np.arange(len(LABELS)))


def _classes_per_client(alpha):
    parts = partition.partition(LABELS, 50, alpha=alpha, size_sigma=0.0, seed=1)
    counts = partition.class_counts(LABELS, parts, 10)
    return float(((counts / counts.sum(1, keepdims=True)) > 0.05).sum(1).mean())


def test_small_alpha_skews_labels_and_sigma_skews_sizes():
    assert _classes_per_client(0.1) < _classes_per_client(100.0) - 3
    even = [len(p) for p in partition.partition(LABELS, 50, alpha=100, size_sigma=0.0, seed=1)]
    skewed = [len(p) for p in partition.partition(LABELS, 50, alpha=100, size_sigma=1.5, seed=1)]
    assert np.std(skewed) > 3 * np.std(even)


def test_partition_bad_input():
    with pytest.raises(SplitInputError, match="alpha"):
        partition.partition(LABELS, 4, alpha=0, size_sigma=1, seed=0)
    with pytest.raises(SplitInputError, match="training samples"):
        partition.partition(LABELS[:3], 4, alpha=1, size_sigma=1, seed=0)


def _counts():
    parts = partition.partition(LABELS, 64, alpha=0.3, size_sigma=1.0, seed=2)
    return partition.class_counts(LABELS, parts, 10)


@pytest.mark.parametrize("method", clusters.METHODS)
def test_every_cluster_gets_clients(method):
    out = clusters.assign(_counts(), 4, method, seed=0)
    assert sorted(set(out.tolist())) == [0, 1, 2, 3]


def test_size_balanced_and_label_aware_beat_random():
    counts = _counts()
    pooled = counts.sum(0) / counts.sum()

    def spread(a):  # (max/min cluster samples, mean L1 distance of cluster class mix to pooled)
        loads = np.array([counts[a == c].sum() for c in range(4)])
        mixes = np.array([counts[a == c].sum(0) / counts[a == c].sum() for c in range(4)])
        return loads.max() / loads.min(), np.abs(mixes - pooled).sum(1).mean()

    rnd = spread(clusters.assign(counts, 4, "random", seed=0))
    size = spread(clusters.assign(counts, 4, "size", seed=0))
    label = spread(clusters.assign(counts, 4, "label", seed=0))
    assert size[0] < 1.02 < rnd[0]
    assert label[1] < rnd[1] and label[0] < 1.15


def test_cluster_bad_input():
    with pytest.raises(SplitInputError, match="5 clusters for 4 clients"):
        clusters.assign(np.ones((4, 10)), 5, "size", seed=0)
    with pytest.raises(SplitInputError, match="cluster 2 has no clients"):
        clusters.check(np.array([0, 1, 0, 1]), 3)
    with pytest.raises(SplitInputError, match="out of range"):
        clusters.check(np.array([0, 3]), 2)
    with pytest.raises(SplitInputError, match="unknown cluster assignment"):
        clusters.assign(np.ones((4, 10)), 2, "kmeans", seed=0)
