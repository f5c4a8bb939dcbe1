"""`unbroken run --resume`: a job that gave up goes on from its newest valid checkpoint and
ends with the weights of a run that never stopped, bit for bit (issue 14)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import reap
from .conftest import _procs_of, events, run_job

pytestmark = pytest.mark.timeout(400)

SCRIPT = str(Path(__file__).parent / "scripts" / "resume_job.py")
ARGS = ["--world-size", "4", "--checkpoint-every", "4", "--chunk-kb", "1"]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unbroken.cli", "run", "--no-progress", "--json", *args],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("ref") / "ref", *ARGS, SCRIPT)


def _check_resumed(run_dir: Path, resumed: dict, reference: dict) -> dict:
    assert resumed["ok"] and resumed["steps"] == reference["steps"] == 16
    assert resumed["weights_sha256"] == reference["weights_sha256"]
    [r] = resumed["resumes"]
    assert r["steps_lost"] == r["stopped_after_step"] - r["from_step"] == resumed["steps_lost"]
    restores = [e for e in events(run_dir) if e["kind"] == "tier2_restore" and e["fields"]["reason"] == "resume"]
    assert sorted(e["rank"] for e in restores) == [0, 1, 2, 3]
    assert {e["fields"]["step"] for e in restores} == {r["from_step"]}
    return r


def test_a_job_that_gave_up_resumes_from_its_checkpoint_bitwise_equal(tmp_path, reference):
    stop = tmp_path / "stop"
    stop.write_text("1")
    run_dir = tmp_path / "job"
    first = _cli("--run-dir", str(run_dir), *ARGS, SCRIPT, env={"RESUME_TEST_STOP": str(stop)})
    assert first.returncode == 1 and "stopped, not retried" in first.stderr, first.stderr[-2000:]
    stop.unlink()  # the user fixes the bug
    again = _cli("--resume", str(run_dir), env={"RESUME_TEST_STOP": str(stop)})
    assert again.returncode == 0, again.stderr[-3000:]
    r = _check_resumed(run_dir, json.loads(again.stdout), reference)
    # the worker that raised at step 10 let its checkpoint of step 8 commit first
    assert r["from_step"] == 8 and r["stopped_after_step"] == 9


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "node-0-lost"])
def test_a_job_interrupted_or_lost_resumes_bitwise_equal(tmp_path, reference, how):
    """Ctrl-C, or node 0's supervisor SIGKILLed (its workers die with it: PR_SET_PDEATHSIG)."""
    run_dir = tmp_path / "job"
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--no-progress", "--json", "--run-dir", str(run_dir),
           *ARGS, SCRIPT]
    job = subprocess.Popen(cmd, env={**os.environ, "RESUME_TEST_PAUSE_S": "0.4"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and job.poll() is None:
            saved = [e for e in events(run_dir) if e["kind"] == "checkpoint_saved" and e["fields"]["step"] == 4] \
                if (run_dir / "events.jsonl").exists() else []
            if len(saved) == 4:
                break
            time.sleep(0.1)
        job.send_signal(how)
        job.communicate(timeout=60)
    finally:
        reap([job])
    assert job.returncode == (130 if how == signal.SIGINT else -signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _procs_of(run_dir.resolve()) and time.monotonic() < deadline:  # orphans die with their parent
        time.sleep(0.1)
    assert _procs_of(run_dir.resolve()) == []
    again = _cli("--resume", str(run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    r = _check_resumed(run_dir, json.loads(again.stdout), reference)
    assert r["from_step"] >= 4


def test_resume_refuses_what_cannot_resume(tmp_path):
    p = _cli("--resume", str(tmp_path))
    assert p.returncode == 2 and "not a run directory" in p.stderr
    p = _cli("--resume", str(tmp_path), "--steps", "3", "--run-dir", str(tmp_path / "other"))
    assert p.returncode == 2 and "drop --run-dir, --steps" in p.stderr


def test_resume_refuses_a_directory_without_a_signed_checkpoint(tmp_path):
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"checkpoint_every": 4}')
    (run_dir / "launch.json").write_text('{"script": ["unbroken.jobs.tiny_gpt"]}')
    from unbroken.runtime.jobkey import ensure_job_key

    ensure_job_key(run_dir)
    p = _cli("--resume", str(run_dir))
    assert p.returncode == 2 and "no checkpoint of every rank, signed by this job" in p.stderr, p.stderr
