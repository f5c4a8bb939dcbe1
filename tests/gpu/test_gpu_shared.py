"""Several ranks on one GPU: NCCL refuses two ranks on a GPU ("Duplicate GPU detected"), so
`--backend gloo --device cuda` trains every rank on the GPU and stages the collectives through
host memory (comm/staged.py). Every op must give what its inputs say, and a SIGKILL at each
phase of a step must leave the final weights bitwise equal to the failure-free run on the GPU."""
from __future__ import annotations

import pytest

from tests.integration.conftest import events, run_job
from tests.integration.test_staged_comm import check_staged

from .need import GPU

WORLD = 3
pytestmark = [*GPU, pytest.mark.timeout(600)]
ARGS = ["--backend", "gloo", "--device", "cuda", "--world-size", str(WORLD), "--n-layer", "2", "--n-embd", "64",
        "--batch-size", "4", "--steps", "8", "--chunk-kb", "16", "--checkpoint-every", "2", "--protect-every", "1"]
KILLS = [("zero1", 4, "backward", 0), ("zero1", 4, "midchunk", 2), ("zero1", 4, "parity", 1),
         ("zero1", 4, "allgather", 0), ("zero1", 5, "optimizer", 3), ("zero1", 1, "build", 0),
         ("ddp", 4, "backward", 0), ("ddp", 5, "optimizer", 1), ("zero2", 4, "parity", 1), ("zero3", 4, "backward", 0)]
_refs: dict = {}


def test_every_op_on_cuda_tensors_of_ranks_sharing_a_gpu_gives_what_its_inputs_say():
    check_staged(WORLD, "cuda")


def _reference(strategy: str, tmp_path_factory) -> dict:
    if strategy not in _refs:
        run_dir = tmp_path_factory.mktemp(f"shared-{strategy}") / "run"
        _refs[strategy] = run_job(run_dir, *ARGS, "--strategy", strategy)
        done = [e["fields"]["device"] for e in events(run_dir) if e["kind"] == "worker_done"]
        assert done == ["cuda:0"] * WORLD, done  # every rank's state lived on the GPU
    return _refs[strategy]


@pytest.mark.parametrize("strategy,step,phase,chunk", KILLS)
def test_a_kill_among_ranks_sharing_a_gpu_is_bitwise_invisible(tmp_path, tmp_path_factory, strategy, step, phase,
                                                              chunk):
    ref = _reference(strategy, tmp_path_factory)
    got = run_job(tmp_path / "run", *ARGS, "--strategy", strategy,
                  "--inject", f"sigkill:rank={WORLD - 1},step={step},phase={phase},chunk={chunk}")
    assert ref["ok"] and got["ok"] and got["ranks_agree"]
    assert got["weights_sha256"] == ref["weights_sha256"]
    assert [r["complete"] for r in got["recoveries"]] == [True] and got["steps_lost"] == 0
