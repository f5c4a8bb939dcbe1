"""Recovery on CUDA with NCCL, one rank per GPU (world size = GPUs visible): a SIGKILL at each
phase of a step must leave the final weights bitwise equal to the failure-free NCCL run."""
from __future__ import annotations

import pytest

from tests.integration.conftest import run_job

from .need import GPUS, gpus

WORLD = GPUS if GPUS >= 2 else 2
pytestmark = [*gpus(2), pytest.mark.timeout(600)]
ARGS = ["--backend", "nccl", "--world-size", str(WORLD), "--n-layer", "2", "--n-embd", "64", "--batch-size", "4",
        "--steps", "8", "--chunk-kb", "16", "--strategy", "zero1", "--checkpoint-every", "2", "--protect-every", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("gpu-reference") / "run", *ARGS)


@pytest.mark.parametrize("step,phase,chunk", [(4, "backward", 0), (4, "midchunk", 2), (4, "parity", 1),
                                              (4, "allgather", 0), (5, "optimizer", 3), (1, "build", 0)])
def test_a_kill_on_an_nccl_job_is_bitwise_invisible(tmp_path, reference, step, phase, chunk):
    got = run_job(tmp_path / "run", *ARGS, "--inject", f"sigkill:rank={WORLD - 1},step={step},phase={phase},chunk={chunk}")
    assert got["ok"] and got["ranks_agree"]
    assert got["weights_sha256"] == reference["weights_sha256"]
    assert [r["complete"] for r in got["recoveries"]] == [True]


def test_the_reference_ran_on_nccl(reference, tmp_path):
    assert reference["ok"] and reference["world_size"] == WORLD
