"""Global sampling: class quotas, present clients only, without replacement; PSL / serialized
schedules; participation accounting; dropouts are deterministic and counted."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.split import partition
from unbroken.split.config import SplitConfig
from unbroken.split.errors import SplitInputError
from unbroken.split.participation import account
from unbroken.split.plan import Federation, rounds
from unbroken.split.sampling import GlobalSampler, present_clients, quotas

LABELS = np.random.default_rng(0).integers(0, 10, 2000)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 500), min_size=2, max_size=12), batch=st.integers(1, 400))
def test_quotas_sum_to_batch_and_follow_proportions(counts, batch):
    counts = np.array(counts)
    q = quotas(counts, batch)
    assert q.sum() == min(batch, counts.sum()) and (q <= counts).all() and (q >= 0).all()
    if counts.sum() >= batch:
        assert np.all(np.abs(q - counts * batch / counts.sum()) < 1 + 1e-9)  # largest remainder: off by < 1


def _fed(n_clients=20, cluster_of=None):
    parts = partition.partition(LABELS, n_clients, alpha=0.3, size_sigma=1.0, seed=4)
    return Federation(LABELS, tuple(parts), partition.owners(parts, len(LABELS)), 10, cluster_of)


def test_global_batch_matches_present_clients_class_mix_without_replacement():
    fed = _fed()
    present = np.ones(20, dtype=bool)
    present[[1, 5, 7]] = False
    s = GlobalSampler(fed.labels, fed.owner, np.arange(20), 10, 50, seed=0, stream=0)
    counts = np.bincount(fed.labels[present[fed.owner]], minlength=10)
    seen = []
    for _ in range(20):  # 1000 samples: less than one epoch of the present clients' data
        b = s.next(present)
        assert len(b) == 50 and present[fed.owner[b]].all()
        assert np.array_equal(np.bincount(fed.labels[b], minlength=10), quotas(counts, 50))
        seen.append(b)
    seen = np.concatenate(seen)
    assert len(np.unique(seen)) == len(seen)


def test_batch_smaller_than_classes_is_refused():
    fed = _fed()
    with pytest.raises(SplitInputError, match="smaller than the 10 classes"):
        GlobalSampler(fed.labels, fed.owner, np.arange(20), 10, 8, seed=0, stream=0)


def test_dropouts_are_deterministic_and_counted():
    a, b = present_clients(3, 7, 100, 0.2), present_clients(3, 7, 100, 0.2)
    assert np.array_equal(a, b) and 5 < (~a).sum() < 40
    assert present_clients(3, 7, 100, 0.0).all()
    cfg = SplitConfig(dataset="digits", clients=20, clusters=2, batch=16, merge_every=2, epochs=1.0, p_drop=0.2)
    fed = _fed(cluster_of=np.arange(20) % 2)
    rds = list(rounds("gcpsl-size", fed, cfg))
    for rd in rds:
        used = np.concatenate([b for w in rd.batches for b in w])
        assert rd.present[fed.owner[used]].all()  # a dropped client sends nothing
    part = account(iter(rds), fed, cfg.samples_per_round)
    assert part["dropped_client_rounds"] == sum(int((~r.present).sum()) for r in rds) > 0


@pytest.mark.parametrize("method", ["serialized", "psl", "gpsl", "gcpsl-random"])
def test_schedules_fill_rounds_and_are_replayable(method):
    cfg = SplitConfig(dataset="digits", clients=20, clusters=2, batch=16, merge_every=3, epochs=2.0)
    fed = _fed(cluster_of=np.arange(20) % 2)
    one, two = list(rounds(method, fed, cfg)), list(rounds(method, fed, cfg))
    assert len(one) == cfg.rounds(len(LABELS))
    for a, b in zip(one, two):
        n = sum(len(x) for w in a.batches for x in w)
        assert n >= cfg.samples_per_round * 0.9
        assert all(np.array_equal(x, y) for wa, wb in zip(a.batches, b.batches) for x, y in zip(wa, wb))


def test_participation_shares():
    cfg = SplitConfig(dataset="digits", clients=20, clusters=2, batch=16, merge_every=3, epochs=2.0)
    fed = _fed(cluster_of=np.arange(20) % 2)
    part = account(rounds("serialized", fed, cfg), fed, cfg.samples_per_round)
    assert part["clients"] == 1.0 and 0 < part["samples"] <= 1
    assert len(part["per_round"]["samples"]) == cfg.rounds(len(LABELS))
    # PSL: every client sends the same number per step, so big clients' data is left out
    psl = account(rounds("psl", fed, cfg), fed, cfg.samples_per_round)
    gpsl = account(rounds("gpsl", fed, cfg), fed, cfg.samples_per_round)
    assert psl["samples"] < gpsl["samples"]
