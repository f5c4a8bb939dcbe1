"""A recovery that finished peers can never join: when it is stranded, and how it ends (runtime/stranded.py)."""
from __future__ import annotations

import json

import pytest

from unbroken.config import RunConfig
from unbroken.runtime.run import summarize
from unbroken.runtime.stranded import Stranding


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _done(*ranks: int, sha: str = "ab" * 32, steps: int = 8) -> dict[int, dict]:
    return {r: {"sha256": sha, "steps": steps} for r in ranks}


def test_a_normal_recovery_is_not_stranded():
    s = Stranding(4, wait_s=5.0, run_dir=None)
    assert not s.check({}, {2: {"fault": "crash"}})
    s.replacing({2: {"fault": "crash"}})
    assert not s.check({})  # nobody finished: the generation can form
    assert not s.check(_done(2))  # only the rank being replaced (its new member finished): nothing to wait for
    assert not s.stranded


def test_a_rank_lost_after_its_peers_finished_ends_the_job_finished(tmp_path):
    s = Stranding(4, wait_s=5.0, run_dir=tmp_path)
    assert s.check(_done(0, 1, 3), {2: {"fault": "hang"}})  # before any generation is published
    assert s.lost == {2: "hang"}
    end = s.ending(_done(0, 1, 3))
    assert end.outcome == "finish" and end.lost == (2,) and end.finished == (0, 1, 3) and end.step == 8
    assert "rank(s) 2 lost (hang) after rank(s) 0,1,3 finished step 8" in end.reason and "\n" not in end.reason


def test_peers_that_finish_after_the_generation_was_published_strand_it(tmp_path):
    s = Stranding(4, wait_s=5.0, run_dir=tmp_path)
    s.replacing({2: {"fault": "crash"}})
    assert not s.check(_done())
    assert s.check(_done(0, 3))  # the survivors finished while the new member waited for them
    assert s.ending(_done(0, 3)) is None  # rank 1 is still finishing
    s.absorb({1: {"fault": "hang"}})  # ... and is lost too: not replaced either
    assert s.check(_done(0, 3), {1: {"fault": "hang"}})
    end = s.ending(_done(0, 3))
    assert end.outcome == "finish" and end.lost == (1, 2)


def test_a_rank_that_neither_finishes_nor_fails_ends_in_a_failure_within_the_wait(tmp_path):
    clock = Clock()
    s = Stranding(4, wait_s=5.0, run_dir=tmp_path, clock=clock)
    assert s.check(_done(0, 1), {2: {"fault": "hang"}})
    assert s.ending(_done(0, 1)) is None
    clock.t += 5.1
    end = s.ending(_done(0, 1))
    assert end.outcome == "fail" and "rank(s) 3 neither finished nor failed within 5 s" in end.reason
    assert f"--resume {tmp_path}" in end.reason


def test_rank_0_lost_before_it_wrote_the_weights_fails_with_a_resume_hint(tmp_path):
    s = Stranding(4, wait_s=5.0, run_dir=tmp_path)
    assert s.check(_done(1, 2, 3), {0: {"fault": "hang"}})
    end = s.ending(_done(1, 2, 3))
    assert end.outcome == "fail" and "rank 0 writes the final weights, which it did not" in end.reason
    assert f"unbroken run --resume {tmp_path}" in end.reason and "\n" not in end.reason


def test_rank_0_lost_after_it_wrote_the_weights_finishes(tmp_path):
    s = Stranding(4, wait_s=5.0, run_dir=tmp_path)
    (tmp_path / "weights.sha256").write_text("cd" * 32 + "  parameters\n")
    assert s.check(_done(1, 2, 3), {0: {"fault": "hang"}})
    assert s.ending(_done(1, 2, 3)).outcome == "fail"  # written, but not the finished ranks' weights
    (tmp_path / "weights.sha256").write_text("ab" * 32 + "  parameters\n")
    assert s.ending(_done(1, 2, 3)).outcome == "finish"


def test_the_wait_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="wait_s must be > 0"):
        Stranding(4, wait_s=0, run_dir=tmp_path)


def _write(run_dir, events):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _job(outcome: str) -> list[dict]:
    evs = [{"time": 1.0, "kind": "run_start", "fields": {}}]
    evs += [{"time": 2.0 + t, "kind": "step", "rank": 0, "fields": {"step": t, "loss": 1.0}} for t in (1, 2)]
    evs += [{"time": 5.0, "kind": "worker_done", "rank": r, "fields": {"weights_sha256": "ab" * 32}} for r in (0, 1, 3)]
    evs.append({"time": 6.0, "kind": "recovery_abandoned", "fields": {
        "outcome": outcome, "reason": "x", "lost": [2], "finished": [0, 1, 3], "step": 2}})
    return evs


def test_the_summary_counts_a_rank_lost_after_the_others_finished(tmp_path):
    cfg = RunConfig(world_size=4)
    _write(tmp_path / "finish", _job("finish"))
    s = summarize(cfg, tmp_path / "finish", wall_s=1.0)
    assert s["ok"] and s["ranks_agree"] and s["ranks_lost_after_finish"] == [2]
    _write(tmp_path / "fail", _job("fail"))  # the leader stopped the job instead: no summary says ok
    s = summarize(cfg, tmp_path / "fail", wall_s=1.0)
    assert not s["ok"] and not s["ranks_agree"] and s["ranks_lost_after_finish"] == []
