"""Multi-process test helpers: run the real CLI, and make sure no process is left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.bench.common import pids_with_env

SMALL = ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--steps", "8", "--world-size", "4",
         "--chunk-kb", "16"]


def _procs_of(run_dir: Path) -> list[int]:
    """Pids whose environment names this run directory."""
    return pids_with_env(f"UNBROKEN_RUN_DIR={run_dir}")


def spawn_ranks(target, *args, world: int = 2, timeout_s: float = 90) -> list:
    """Run target(rank, *args, out_queue) in `world` spawned processes; each puts one item on
    the queue, returned in arrival order. The processes are joined (killed if they hang)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def run_cli(run_dir: Path, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        leftover = _procs_of(run_dir.resolve())
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftover and check:
            time.sleep(0.2)
            pytest.fail(f"processes left behind by the run in {run_dir}: {leftover}")


def run_job(run_dir: Path, *args: str, timeout: float = 240) -> dict:
    p = run_cli(run_dir, *args, timeout=timeout)
    assert p.returncode == 0, f"run failed ({p.returncode}):\n{p.stderr[-3000:]}\n{_logs(run_dir)}"
    return json.loads(p.stdout)


def start_node(run_dir: Path, rank: int, *args: str) -> subprocess.Popen:
    """One node of a two-node job (`unbroken run --nnodes 2`), in its own session."""
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json",
           *args, "--nnodes", "2", "--node-rank", str(rank), "--token", "tok"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, timeout_s: float, *, process: subprocess.Popen | None = None) -> None:
    """Until some rank has logged `step` in run_dir's events (AssertionError past timeout_s); with
    `process` (the launcher), failing at once with its stderr if it exits first (a start it refused)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (run_dir / "events.jsonl").exists() and any(
                e["kind"] == "step" and e["fields"]["step"] >= step for e in events(run_dir)):
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the launcher exited ({process.returncode}) before step {step}: "
                                 f"{process.stderr.read()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached within {timeout_s}s")


def _logs(run_dir: Path) -> str:
    out = []
    for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if "socket.cpp" not in ln]
        out.append(f"--- {f.name}\n" + "\n".join(lines[-12:]))
    return "\n".join(out)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    """Failure-free runs (zero1, zero2 and ddp) whose final weights every faulted run must equal."""
    root = tmp_path_factory.mktemp("reference")
    return {s: {**run_job(root / s, *SMALL, "--strategy", s, "--checkpoint-every", "2"), "run_dir": str(root / s)}
            for s in ("zero1", "zero2", "ddp")}


# The default suite's budget (~15 min on 2 cores): one end-to-end test per recovery path and
# door stays in it; these variants of paths already covered there run with `pytest -m slow`.
SLOW_VARIANTS = {
    "test_recovery.py::test_zero1_sigkill_at_each_phase_is_bitwise_invisible": {  # kept: 1-4-parity-1,
        "1-4-backward-0", "1-4-midchunk-2", "1-4-allgather-0", "4-5-forward-0",  # 4-7-midchunk-2, 4-6-allreduce-0
        "4-5-optimizer-3", "4-6-backward-0", "4-4-optimizer-0", "4-4-parity-1", "4-4-allgather-0"},
    "test_recovery.py::test_ddp_sigkill_recovers_from_a_replica": {"backward", "allgather"},
    "test_recovery_exchange.py::test_a_kill_recovers_bitwise_with_xor_and_by_exchange": {"midchunk-2"},
    "test_recovery.py::test_corrupted_parity_chunk_is_detected_and_tier2_used": {"backward"},
    "test_recovery.py::test_a_survivor_a_step_behind_is_never_the_source": {"ddp-replica"},
    "test_recovery.py::test_zero1_without_tier1_never_takes_a_peer_shard": {"collerr:rank=0,step=5,phase=reduced-local"},
    "test_recovery.py::test_two_failures_in_sequence": None,  # sequences: the chaos schedules
    "test_recovery.py::test_auto_interval_is_chosen_once_and_kills_stay_bitwise": None,
    "test_recovery_groups.py::test_parity_group_of_two_in_four_ranks": {
        "1-4-backward-0-1", "2-5-optimizer-3-4", "2-4-allgather-0-4"},
    "test_recovery_groups.py::test_two_kills_in_one_step_in_two_groups_of_eight_ranks": None,  # 10 processes
    "test_cli.py::test_four_ranks_twenty_steps_complete_and_are_deterministic": None,
    "test_cli.py::test_user_script_example_survives_a_kill": None,  # test_byo's shipped ports do it too
    "test_chaos.py::test_a_schedule_that_cannot_pass_is_reported_with_a_command_that_reproduces_it": None,
    "test_hardening.py::test_a_whole_node_lost_is_one_incident_and_its_ranks_are_replaced": {"sigstop"},
    "test_hardening.py::test_back_to_back_failures_grow_an_auto_pool_and_cold_takeovers_are_named": None,
    "test_hardening.py::test_skipping_a_nan_step_is_deterministic_across_a_kill": None,
    "test_byo.py::test_shipped_port_changes_few_lines_and_means_the_same": {"nanogpt"},
    "test_detect_runtime.py::test_process_faults_are_operable_and_recovered_in_place": {
        "sigstop:rank=2,step=4,phase=optimizer-hang-True", "exception:rank=3,step=4,phase=forward-exception-False"},
    "test_tee.py::test_a_shadow_that_takes_rank_0_is_shown_as_rank_0": None,
    "test_recovery_zero2.py::test_zero2_sigkill_at_each_phase_is_bitwise_invisible": {
        "forward-0", "backward-0", "allreduce-0", "reduced-0", "optimizer-0", "parity-1"},
    "test_recovery_zero2.py::test_zero2_every_rank_lost_restores_tier2": None,
    "test_recovery_zero2.py::test_zero2_runs_are_bitwise_reproducible": None,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{Path(item.fspath).name}::{item.originalname}"
        if name not in SLOW_VARIANTS:
            continue
        params = SLOW_VARIANTS[name]
        param = item.callspec.id if hasattr(item, "callspec") else None
        if params is None or param in params:
            item.add_marker(pytest.mark.slow)
