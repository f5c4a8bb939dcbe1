"""Each method's data schedule, round by round: which samples each worker trains on at each
step. A pure function of (config, partition, clusters): the trainer, the cluster workers
and the participation accounting all replay the same schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from unbroken.split.config import SplitConfig
from unbroken.split.sampling import ClientCycles, GlobalSampler, present_clients

_ORDER = 4  # RNG stream tag of the serialized baseline's turn order


@dataclass(frozen=True)
class Federation:
    """The training set as the clients hold it: labels, clients' sample indices, sample owners,
    and (for GCPSL) each client's cluster."""
    labels: np.ndarray
    clients: tuple[np.ndarray, ...]
    owner: np.ndarray
    n_classes: int
    cluster_of: np.ndarray | None = None

    @property
    def n_clients(self) -> int:
        return len(self.clients)


@dataclass(frozen=True)
class Round:
    """Round `index` (1-based): batches[w][s] = sample indices of worker w's step s."""
    index: int
    batches: tuple[tuple[np.ndarray, ...], ...]
    present: np.ndarray  # present[i]: client i did not drop out of this round


def rounds(method: str, fed: Federation, cfg: SplitConfig) -> Iterator[Round]:
    """The schedule of `method` for cfg.rounds(n) rounds."""
    n_rounds = cfg.rounds(len(fed.labels))
    if method.startswith("gcpsl"):
        return _gcpsl(fed, cfg, n_rounds)
    return {"gpsl": _gpsl, "psl": _psl, "serialized": _serialized}[method](fed, cfg, n_rounds)


def _present(fed: Federation, cfg: SplitConfig, r: int) -> np.ndarray:
    return present_clients(cfg.seed, r, fed.n_clients, cfg.p_drop)


def _gcpsl(fed: Federation, cfg: SplitConfig, n_rounds: int) -> Iterator[Round]:
    """Every cluster runs GPSL on its own clients, merge_every steps per round."""
    assert fed.cluster_of is not None, "GCPSL needs a cluster assignment"
    samplers = [GlobalSampler(fed.labels, fed.owner, np.flatnonzero(fed.cluster_of == c), fed.n_classes,
                              cfg.batch, cfg.seed, stream=1 + c) for c in range(cfg.clusters)]
    for r in range(1, n_rounds + 1):
        present = _present(fed, cfg, r)
        batches = tuple(tuple(s.next(present) for _ in range(cfg.merge_every)) for s in samplers)
        yield Round(r, batches, present)


def _gpsl(fed: Federation, cfg: SplitConfig, n_rounds: int) -> Iterator[Round]:
    """One server samples globally over all clients: as many steps per round as all clusters take."""
    sampler = GlobalSampler(fed.labels, fed.owner, np.arange(fed.n_clients), fed.n_classes, cfg.batch,
                            cfg.seed, stream=0)
    for r in range(1, n_rounds + 1):
        present = _present(fed, cfg, r)
        yield Round(r, (tuple(sampler.next(present) for _ in range(cfg.clusters * cfg.merge_every)),), present)


def _psl(fed: Federation, cfg: SplitConfig, n_rounds: int) -> Iterator[Round]:
    """Every present client sends psl_client_batch of its own samples per step (no global sampling)."""
    cycles = ClientCycles(list(fed.clients), cfg.seed)
    for r in range(1, n_rounds + 1):
        present = _present(fed, cfg, r)
        who = np.flatnonzero(present)
        steps, done = [], 0
        while done < cfg.samples_per_round and len(who):
            batch = np.concatenate([cycles.take(int(i), cfg.psl_client_batch) for i in who])
            steps.append(batch)
            done += len(batch)
        yield Round(r, (tuple(steps),), present)


def _serialized(fed: Federation, cfg: SplitConfig, n_rounds: int) -> Iterator[Round]:
    """One workload at a time (vanilla split learning): the clients take turns in a seeded
    order, each turn one serial_batch step of that client's own data, the client segment
    handed on to the next client; a client that dropped out of the round loses its turn."""
    cycles = ClientCycles(list(fed.clients), cfg.seed)
    order_no = 0
    for r in range(1, n_rounds + 1):
        present = _present(fed, cfg, r)
        steps, done = [], 0
        while done < cfg.samples_per_round and present.any():
            for i in np.random.default_rng([cfg.seed, _ORDER, order_no]).permutation(fed.n_clients):
                if present[i] and done < cfg.samples_per_round:
                    steps.append(cycles.take(int(i), cfg.serial_batch))
                    done += len(steps[-1])
            order_no += 1
        yield Round(r, (tuple(steps),), present)
