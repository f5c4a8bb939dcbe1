"""GCPSL's cluster workers under `unbroken run`: a worker really SIGKILLed mid-round is
replaced in place and the round completes; dropped clients are skipped and counted; the
merged weights match the naive in-process reference (clusters one after another)."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from unbroken.split import data, train
from unbroken.split.config import SplitConfig
from unbroken.split.launch import run_gcpsl
from unbroken.split.participation import account
from unbroken.split.plan import rounds

from .conftest import _procs_of

CFG = SplitConfig(dataset="digits", clients=16, clusters=2, merge_every=4, batch=16, epochs=2.0, hidden=32,
                  p_drop=0.1)


def _job(tmp_path, name, inject=()):
    split = data.digits()
    fed = train.federation(split, CFG, "gcpsl-label")
    try:
        res = run_gcpsl(CFG, "gcpsl-label", tmp_path / name, inject=inject, cluster_of=fed.cluster_of,
                        timeout_s=150)
    finally:
        left = _procs_of((tmp_path / name / "run").resolve())
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind: {left}"
    return split, fed, res


def _reference(split, fed):
    torch.set_num_threads(1)
    return train.run("gcpsl-label", split, CFG, fed)


@pytest.mark.timeout(200)
def test_killed_cluster_worker_recovers_in_place_and_dropouts_are_counted(tmp_path):
    kill = "sigkill:rank=1,step=6,phase=backward"  # after rank 1's local round, before the merge
    split, fed, res = _job(tmp_path, "kill", (kill,))
    n_rounds = CFG.rounds(len(fed.labels))
    assert len(res.summary["recoveries"]) == 1 and res.summary["steps_lost"] == 0
    assert [p[0] for p in res.curve.points] == list(range(1, n_rounds + 1))  # every round completed
    curve, ref = _reference(split, fed)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(res.state[k], v, rtol=0, atol=1e-5)
    assert abs(res.curve.final - curve.final) < 0.01
    part = account(rounds("gcpsl-label", fed, CFG), fed, CFG.samples_per_round)
    assert part["dropped_client_rounds"] > 0  # skipped (the reference skips the same ones) and counted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_run_is_bitwise_the_failure_free_run(tmp_path):
    _, _, clean = _job(tmp_path, "clean")
    _, _, killed = _job(tmp_path, "kill", ("sigkill:rank=0,step=3,phase=backward",))
    assert len(killed.summary["recoveries"]) == 1
    assert killed.summary["weights_sha256"] == clean.summary["weights_sha256"]
    assert [p[2] for p in killed.curve.points] == [p[2] for p in clean.curve.points]
