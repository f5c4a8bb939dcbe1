"""The benchmarks' pure parts: Young/Daly, layouts, log analysis, result schemas; a tiny threaded rebuild."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from unbroken.bench import baseline, baseline_job, protect, rebuild, recovery, throughput
from unbroken.bench.common import steady_step_times, write_result
from unbroken.config import ModelConfig, RunConfig
from unbroken.events import Event


# --- Young/Daly ------------------------------------------------------------------------------
def test_young_daly_interval_is_sqrt_two_save_mtbf():
    assert recovery.young_daly_interval_s(0.5, 100.0) == pytest.approx(10.0)
    assert recovery.young_daly_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))


def test_checkpoint_every_rounds_to_whole_steps_at_least_one():
    assert recovery.checkpoint_every_steps(0.5, 100.0, 2.0) == 5
    assert recovery.checkpoint_every_steps(1e-4, 1.0, 10.0) == 1


@pytest.mark.parametrize("args", [(0.0, 10.0), (1.0, 0.0), (-1.0, 5.0)])
def test_young_daly_rejects_non_positive(args):
    with pytest.raises(ValueError, match="must be > 0"):
        recovery.young_daly_interval_s(*args)


def test_mtbf_steps_is_mean_spacing_from_start():
    assert recovery.mtbf_steps([(1, 16), (2, 31), (3, 47)]) == pytest.approx(47 / 3)
    with pytest.raises(ValueError):
        recovery.mtbf_steps([])


# --- rebuild layout and a tiny threaded run ---------------------------------------------------
@pytest.mark.parametrize("nbytes,k", [(64 << 20, 4), (1 << 20, 4), (3 << 20, 2), (100_000, 8), (1, 4)])
def test_state_layout_covers_nbytes_in_whole_windows(nbytes, k):
    n, e = rebuild.state_layout(nbytes, k)
    assert n % e == 0 and e % 16 == 0
    assert (n // e) % (k - 1) == 0
    assert n * 3 * 4 >= nbytes


def test_threaded_rebuild_is_bitwise_and_reports_every_key():
    r = rebuild.run_threads(nbytes=256 << 10, world=4, lost=1, repeats=1)
    assert r["verified_bitwise"] is True
    assert r["memory_overhead"] == pytest.approx(1 / 3, abs=1e-3)
    for key in ("rebuild_s", "rebuild_gbps", "delta_update_s", "allreduce_same_bytes_s", "delta_vs_allreduce",
                "build_s", "rebuild_phases", "delta_stage_s", "delta_collectives_s"):
        assert key in r


# --- baseline job pieces ----------------------------------------------------------------------
def test_parse_kill():
    assert baseline_job.parse_kill("2:30") == (2, 30)
    for bad in ("2", "a:3", "2:", ":3"):
        with pytest.raises(ValueError, match="RANK:STEP"):
            baseline_job.parse_kill(bad)


def test_a_kill_fires_once_across_restarts(tmp_path):
    assert baseline_job.claim_kill(tmp_path, 1, 15) is True
    assert baseline_job.claim_kill(tmp_path, 1, 15) is False
    assert baseline_job.claim_kill(tmp_path, 2, 15) is True


def test_checkpoint_round_trip_keeps_newest(tmp_path):
    from unbroken.models import VOCAB_SIZE
    from unbroken.models.gpt import build_model

    cfg = RunConfig(model=ModelConfig(n_layer=1, n_head=1, n_embd=8, seq_len=4))
    model = build_model(cfg.model, VOCAB_SIZE, seed=0)
    opt = baseline_job.make_optimizer(model, cfg)
    model.loss(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    for step in (2, 4, 6):
        baseline_job.save_checkpoint(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("*.pt"))] == ["step_00000004.pt", "step_00000006.pt"]
    fresh = build_model(cfg.model, VOCAB_SIZE, seed=1)
    fresh_opt = baseline_job.make_optimizer(fresh, cfg)
    assert baseline_job.load_checkpoint(baseline_job.latest_checkpoint(tmp_path), fresh, fresh_opt) == 6
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert baseline_job.latest_checkpoint(tmp_path / "nothing") is None


def test_torchrun_command_restarts_with_c10d():
    cmd = baseline.torchrun_command(Path("/r"), nproc=4, port=1234, every=3, kills=[(1, 5), (2, 9)])
    s = " ".join(cmd)
    assert "--max-restarts 10" in s and "--rdzv-backend c10d" in s and "127.0.0.1:1234" in s
    assert "--kill 1:5 --kill 2:9" in s and "--checkpoint-every 3" in s


def _rec(t, event, rank=0, restart=0, **f):
    return {"t": t, "event": event, "rank": rank, "restart": restart, **f}


def _killed_log():
    recs = [_rec(0.0, "process_start", r) for r in range(2)] + [_rec(5.0, "ready", r, loaded_step=0) for r in range(2)]
    recs += [_rec(5.0 + s, "step", step=s, step_s=1.0) for s in range(1, 6)]
    recs += [_rec(9.1, "checkpoint_saved", step=4, save_s=0.1), _rec(10.5, "kill", 1, step=6)]
    recs += [_rec(11.0 + 0.1 * r, "process_start", r, 1) for r in range(2)]
    recs += [_rec(16.0 + 0.5 * r, "ready", r, 1, loaded_step=4) for r in range(2)]
    recs += [_rec(17.5, "step", 0, 1, step=5, step_s=1.0), _rec(18.5, "step", 0, 1, step=6, step_s=1.0),
             _rec(19.0, "done", 0, 1, weights_sha256="ab")]
    return sorted(recs, key=lambda r: r["t"])


def test_kill_recoveries_from_a_log():
    (k,) = baseline.kill_recoveries(_killed_log())
    assert k["recovery_s"] == pytest.approx(7.0)      # 10.5 -> first step after restart at 17.5
    assert k["regain_s"] == pytest.approx(8.0)        # -> step 6 done again at 18.5
    assert k["steps_redone"] == 2 and k["completed_steps_discarded"] == 1
    assert k["breakdown"] == pytest.approx({"restart": 0.5, "init": 5.5, "redo": 1.0})


def test_baseline_summary_and_throughput():
    recs = _killed_log()
    s = baseline.summary({"records": recs, "wall_s": 20.0, "t0": 0.0}, [(1, 6)], steps=6)
    assert s["weights_sha256"] == "ab" and s["checkpoints_saved"] == 1
    assert s["productive_fraction"] == pytest.approx(6 * 1.0 / 20.0)
    assert s["timeline"]["kills_t"] == [10.5]
    assert baseline.throughput(recs, tokens_per_step=100) == pytest.approx(100.0)
    with pytest.raises(RuntimeError, match="2 were scheduled"):
        baseline.summary({"records": recs, "wall_s": 20.0, "t0": 0.0}, [(1, 6), (2, 9)], steps=6)


# --- result schemas ---------------------------------------------------------------------------
def test_steady_step_times_skip_warmup_and_other_ranks():
    evs = [Event(time=float(s), kind="step", rank=r, fields={"step": s, "step_s": 0.1 * s})
           for s in range(1, 6) for r in (0, 1)]
    assert steady_step_times(evs) == pytest.approx([0.3, 0.4, 0.5])


def test_throughput_result_schema():
    per = {n: {"tokens_per_s": 1000.0 * n ** 0.5, "wall_s": 1.0, "median_step_s": 0.1, "tokens_per_step": 512 * n}
           for n in (1, 2, 4)}
    r = throughput.throughput_result(per, steps=10)
    assert r["ranks"] == {"1": 1000.0, "2": pytest.approx(1414.2, rel=1e-3), "4": 2000.0}
    assert r["steps"] == 10 and r["scaling"]["4"] == pytest.approx(2.0)
    assert r["per_rank_efficiency"]["4"] == pytest.approx(0.5)
    assert not any("ddp" in key for key in r)  # the comparison with native peers is bench overhead


def test_protect_result_schema():
    enc = {"encode_gbps": 6.0, "memcpy_gbps": 10.0, "encode_vs_memcpy": 0.6, "nbytes": 64 << 20}
    r = protect.protect_result(enc, rebuild.aggregate(_fake_members(), lost=1))
    assert r["memory_overhead"] == pytest.approx(1 / 3) and r["memory_overhead_expected"] == pytest.approx(1 / 3)
    for key in ("encode_gbps", "memcpy_gbps", "encode_vs_memcpy", "rebuild_s", "delta_update_s",
                "allreduce_same_bytes_s"):
        assert key in r
    assert not any(key.startswith("step_overhead") for key in r)  # moved to bench overhead


def test_protect_and_throughput_tables_render():
    from rich.console import Console

    enc = {"encode_gbps": 6.0, "memcpy_gbps": 10.0, "encode_vs_memcpy": 0.6, "nbytes": 64 << 20}
    rb = rebuild.aggregate(_fake_members(), lost=1)
    per = {n: {"tokens_per_s": 1000.0 * n, "wall_s": 1.0, "median_step_s": 0.1, "tokens_per_step": 512 * n}
           for n in (1, 2)}
    console = Console(record=True, width=200)
    console.print(protect.table(protect.protect_result(enc, rb)))
    console.print(throughput.table(throughput.throughput_result(per, steps=10)))
    out = console.export_text()
    assert "encode / memcpy" in out and "rebuild one rank" in out and "2000" in out
    assert "step overhead, tier" not in out and "DDP" not in out


def _fake_members():
    out = []
    for r in range(4):
        out.append({"rank": r, "bytes_protected": 3000, "parity_bytes": 1000, "n_windows": 2, "build_s": 0.1,
                    "rebuild": [{"total_s": 0.2 + 0.1 * i, "decode_s": 0.05, "reduce_s": 0.1, "install_s": 0.05}
                                for i in range(3)],
                    "verified": True if r == 1 else None,
                    "delta_update_s": {"total": [0.3, 0.3, 0.3], "stage": [0.1] * 3, "comm": [0.2] * 3},
                    "allreduce_s": [0.15, 0.15 + 0.01 * r, 0.15]})
    return out


def test_rebuild_aggregate_uses_lost_member_and_slowest_collective():
    rb = rebuild.aggregate(_fake_members(), lost=1)
    assert rb["rebuild_s"] == pytest.approx(0.3) and rb["verified_bitwise"] is True
    assert rb["allreduce_same_bytes_s"] == pytest.approx(0.15)
    assert rb["delta_vs_allreduce"] == pytest.approx(2.0)


def test_recovery_result_schema_and_ratio():
    base = {"recovery_s": [8.0, 6.0, 7.0], "regain_s": [9.0, 6.0, 8.0], "steps_redone": [2, 1, 1],
            "breakdown": {}, "wall_s": 50.0, "productive_fraction": 0.5, "median_step_s": 0.4}
    ub = {"recovery_s": [1.0, 0.5, 0.7], "steps_redone": [1, 1, 1], "steps_lost": 0,
          "breakdown": {p: [0.1, 0.1, 0.1] for p in recovery.PHASES}, "wall_s": 40.0, "failure_free_wall_s": 36.0}
    r = recovery.recovery_result(steps=30, world=4, kills=[(1, 8), (2, 17), (3, 25)],
                                 save={"save_s": 0.1, "bytes": 10}, mtbf_s=3.0, every=2, base=base,
                                 base_ref_wall=20.0, ub=ub, weights_match=True, state_bytes=1000)
    assert r["ratio"] == pytest.approx(7.0 / 0.7)
    assert r["baseline"]["checkpoint_every"] == 2 and r["baseline"]["save_s"] == 0.1
    assert r["unbroken"]["steps_lost"] == 0 and r["weights_match_reference"] is True
    assert r["baseline"]["lost_to_failures_s"] == pytest.approx(30.0)
    assert r["unbroken"]["lost_to_failures_s"] == pytest.approx(4.0)
    assert r["unbroken"]["steps_per_wall_s"] == pytest.approx(30 / 40)
    from unbroken.sim.calibrate import calibration_from_dict  # the simulator must be able to read it

    cal = calibration_from_dict(r, "test")
    assert cal.unbroken_recovery_s == pytest.approx(2.2 / 3) and cal.ranks == 4


def test_write_result_is_json_with_machine(tmp_path):
    import json

    p = write_result("x", {"a": 1}, tmp_path)
    d = json.loads(p.read_text())
    assert d["a"] == 1 and d["benchmark"] == "x" and "cpus" in d["machine"]


def test_timeline_plot_writes_png(tmp_path):
    from unbroken.bench.plot import plot_timelines

    s = {"t": [1.0, 2.0, 3.0], "step": [1, 2, 3], "kills_t": [2.5]}
    plot_timelines({"a": s, "b": s}, tmp_path / "t.png", title="t")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_commands_are_registered():
    from typer.testing import CliRunner

    from unbroken.cli import app

    out = CliRunner().invoke(app, ["bench", "--help"]).output
    assert all(name in out for name in ("throughput", "protect", "recovery"))


def test_a_launcher_call_reaps_every_process_it_tagged_even_outside_its_session(tmp_path):
    import subprocess
    import sys
    import time

    from unbroken.bench.common import reap_tagged, tagged_env

    env, tag = tagged_env()
    # a grandchild in a session of its own, as torchrun starts its workers: killpg cannot reach it
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(60)'], start_new_session=True)"], env=env)
    child.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not (pids := reap_tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 1
    time.sleep(0.2)
    assert reap_tagged(tag) == []  # killed (init reaps the orphan)
