"""Participation accounting: per round, the share of clients and of training samples that
took part; over the run, the mean of those shares per epoch-sized window of rounds."""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from unbroken.split.plan import Federation, Round


def account(rounds: Iterable[Round], fed: Federation, samples_per_round: int) -> dict:
    """Replay a schedule: per-round shares, per-window (one training set's worth of samples)
    shares of distinct clients and samples used, and dropped client-rounds."""
    n = len(fed.labels)
    window = max(1, math.ceil(n / samples_per_round))
    used = np.zeros(n, dtype=bool)
    per_round_clients, per_round_samples, win_clients, win_samples = [], [], [], []
    dropped = 0
    for rd in rounds:
        idx = np.concatenate([b for worker in rd.batches for b in worker]) if any(rd.batches) else np.empty(0, int)
        idx = idx.astype(np.int64)
        uniq = np.unique(idx)
        per_round_samples.append(len(uniq) / n)
        per_round_clients.append(len(np.unique(fed.owner[uniq])) / fed.n_clients)
        dropped += int((~rd.present).sum())
        used[uniq] = True
        if rd.index % window == 0:
            win_samples.append(float(used.mean()))
            win_clients.append(len(np.unique(fed.owner[used])) / fed.n_clients)
            used[:] = False
    if not win_samples:  # a run shorter than one window: its whole span
        win_samples.append(float(used.mean()))
        win_clients.append(len(np.unique(fed.owner[used])) / fed.n_clients)
    return {"clients": float(np.mean(win_clients)), "samples": float(np.mean(win_samples)),
            "window_rounds": window, "dropped_client_rounds": dropped,
            "per_round": {"clients": per_round_clients, "samples": per_round_samples}}
