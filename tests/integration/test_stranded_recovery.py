"""A rank lost after its peers finished the job: no generation can form, so the job ends, in bounded
time, on what is committed (runtime/stranded.py) instead of waiting for a recovery forever."""
from __future__ import annotations

import json

import pytest

from .conftest import SMALL, events, run_cli

pytestmark = pytest.mark.timeout(300)

_BOUND_S = 120  # the job ends well within this (it used to wait for a recovery that never ends)


def _abandoned(run_dir) -> list[dict]:
    return [e["fields"] for e in events(run_dir) if e["kind"] == "recovery_abandoned"]


def test_a_rank_hung_after_the_others_finished_ends_the_job_finished(tmp_path):
    """Rank 2 stops in finish(), after the last step; ranks 0, 1 and 3 write their weights and exit."""
    p = run_cli(tmp_path / "r", *SMALL, "--inject", "sigstop:rank=2,step=8,phase=done", timeout=_BOUND_S)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["ok"] and got["ranks_agree"] and got["steps"] == 8
    assert got["ranks_lost_after_finish"] == [2] and set(got["rank_weights_sha256"]) == {"0", "1", "3"}
    [end] = _abandoned(tmp_path / "r")
    assert end["outcome"] == "finish" and end["lost"] == [2] and end["finished"] == [0, 1, 3] and end["step"] == 8
    evs = events(tmp_path / "r")
    assert [e["fields"]["fault"] for e in evs if e["kind"] == "fault_detected"] == ["hang"]
    # whether a generation was published before the peers' done records landed or not, none completed
    assert not any(e["kind"] == "recovered" for e in evs)
    assert (tmp_path / "r" / "weights.pt").exists()


def test_rank_0_hung_after_the_others_finished_fails_with_one_line(tmp_path):
    """ddp: only rank 0 writes checkpoints, so it stops at the last step's checkpoint while the
    others finish. The final weights (rank 0's to write) are missing: the job fails, saying how to resume."""
    p = run_cli(tmp_path / "r", *SMALL, "--strategy", "ddp", "--checkpoint-every", "4",
                "--inject", "sigstop:rank=0,step=8,phase=checkpoint", timeout=_BOUND_S)
    assert p.returncode == 2, p.stderr[-3000:]
    [line] = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert "rank(s) 0 lost (hang) after rank(s) 1,2,3 finished step 8" in line
    assert f"unbroken run --resume {tmp_path / 'r'}" in line
    [end] = _abandoned(tmp_path / "r")
    assert end["outcome"] == "fail" and end["lost"] == [0] and end["finished"] == [1, 2, 3]
    assert not (tmp_path / "r" / "weights.pt").exists()
