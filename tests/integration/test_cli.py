"""The job end to end through the CLI: completion, determinism, bad input, tokens, two nodes, signals."""
from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.procs import reap, start_leader
from .conftest import SMALL, _procs_of, events, run_cli, run_job

pytestmark = pytest.mark.timeout(300)
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tutorial_unbroken.py")


def test_four_ranks_twenty_steps_complete_and_are_deterministic(tmp_path):
    args = [*SMALL, "--steps", "20", "--seed", "3"]
    a = run_job(tmp_path / "a", *args)
    b = run_job(tmp_path / "b", *args)
    assert a["ok"] and a["steps"] == 20 and a["ranks_agree"]
    assert a["weights_sha256"] == b["weights_sha256"]
    for key in ("steps", "world_size", "final_loss", "tokens_per_s", "weights_sha256", "wall_s"):
        assert key in a
    digest = (tmp_path / "a" / "weights.sha256").read_text().split()[0]
    assert digest == a["weights_sha256"]


def test_final_weights_and_the_protection_each_rank_holds(reference):
    """The failure-free reference runs: weights.pt (streamed from the flat buffer's views) loads as
    the trained parameters bit for bit; worker_done says what each rank's protection holds."""
    for strategy, res in reference.items():
        run_dir = Path(res["run_dir"])
        state = torch.load(run_dir / "weights.pt", weights_only=True)
        trained = [name for name, _ in torch.load(run_dir / "layout.pt", weights_only=False)["params"]]
        flat = torch.cat([state[name].reshape(-1) for name in trained])
        assert hashlib.sha256(flat.numpy()).hexdigest() == res["weights_sha256"]
        done = {e["rank"]: e["fields"]["protection_bytes"] for e in events(run_dir) if e["kind"] == "worker_done"}
        assert sorted(done) == [0, 1, 2, 3]
        if strategy == "ddp":  # replicas need no parity; rank 0 alone stages the replica's checkpoint
            assert all(p["parity"] == 0 and p["gradient_log"] == 0 for p in done.values())
            assert done[0]["checkpoint_staging"] > 0 and all(done[r]["checkpoint_staging"] == 0 for r in (1, 2, 3))
            continue
        for parts in done.values():  # sharded: tier 1 on every rank, each checkpoints its own shard
            assert parts["parity"] > 0 and parts["parity_pipeline"] > 0 and parts["snapshot"] > 0
            assert parts["gradient_log"] > 0 and parts["checkpoint_staging"] > parts["snapshot"] // 2


def test_user_script_example_survives_a_kill(tmp_path):
    common = ["--world-size", "4", EXAMPLE, "--epochs", "2", "--snapshot", str(tmp_path / "snapshot.pt")]
    ref = run_job(tmp_path / "ref", *common)
    (tmp_path / "snapshot.pt").unlink()  # else the second run resumes from it (the script's own resume logic)
    got = run_job(tmp_path / "got", "--inject", "sigkill:rank=1,step=10,phase=optimizer", *common)
    assert got["weights_sha256"] == ref["weights_sha256"]
    assert len(got["recoveries"]) == 1


@pytest.mark.parametrize("args,needle", [
    (["--world-size", "0"], "world_size must be an integer >= 1"),
    (["--steps", "0"], "steps must be an integer >= 1"),
    (["--strategy", "zero9"], "strategy must be one of"),
    (["--inject", "sigkill:rank=9,step=2"], "names rank 9"),
    (["--inject", "explode:rank=1"], "unknown fault kind"),
    (["--protect-every", "0"], "protect_every must be an integer >= 1 or 'auto'"),
    (["--protect-every", "often"], "--protect-every must be an integer or 'auto'"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    p = run_cli(tmp_path / "r", *args)
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r" / "events.jsonl").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--steps", "5", "--inject", "sigkill:rank=0,step=99"], "can never fire: the run has 5 steps"),
    (["--inject", "sigkill:rank=0,step=2,phase=backward,chunk=1"], "can never fire: phase backward has no chunks"),
    (["--inject", "sigkill:rank=0,step=3,phase=shadow"], "can never fire: phase shadow runs"),
    (["--checkpoint-every", "0", "--inject", "sigkill:rank=0,step=0,phase=checkpoint"], "checkpoints are off"),
])
def test_a_fault_that_can_never_fire_is_refused_in_one_line(tmp_path, args, needle):
    p = run_cli(tmp_path / "r", *args)
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert p.stderr.startswith("error: fault ") and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.mark.timeout(240)
def test_faults_that_could_fire_but_did_not_are_named(tmp_path):
    # no failure: no shadow is ever assigned and no recovery runs, so neither fault fires; the slow one does
    unfired = ["sigkill:rank=1,step=1,phase=shadow,chunk=0", "exception:rank=2,step=3,phase=recovery,chunk=0"]
    run_dir = tmp_path / "r"
    args = [*SMALL, "--inject", "slow:rank=0,step=2,phase=forward,ms=1"]
    for spec in unfired:
        args += ["--inject", spec]
    s = run_job(run_dir, *args)
    assert s["ok"] and s["faults_not_fired"] == unfired
    fired = [e for e in events(run_dir) if e["kind"] == "fault_injected"]
    assert [(e["rank"], e["fields"]["fault"], e["fields"]["step"]) for e in fired] == [(0, "slow", 2)]
    p = subprocess.run([sys.executable, "-m", "unbroken.cli", "report", str(run_dir), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["not_fired"] == 2
    assert f"| injected but not fired | 2 ({', '.join(unfired)}) |" in (run_dir / "report.md").read_text()


def test_a_gradient_log_that_cannot_fit_names_the_largest_k(tmp_path):
    p = run_cli(tmp_path / "r", *SMALL, "--protect-every", "100000000")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "gradient log" in p.stderr and "use --protect-every" in p.stderr


@pytest.mark.parametrize("text,needle", [
    ("steps = 10\nbogus = 1\n", "unknown config key 'bogus'"),
    ("steps = [[[\n", "is not valid TOML"),
    ("[model]\nn_head = 3\n", "must be divisible"),
])
def test_bad_config_file(tmp_path, text, needle):
    cfg = tmp_path / "job.toml"
    cfg.write_text(text)
    p = run_cli(tmp_path / "r", "--config", str(cfg))
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


def test_port_in_use_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = run_cli(tmp_path / "r", *SMALL, "--port", str(s.getsockname()[1]))
    assert p.returncode == 2 and "in use" in p.stderr
    assert not (tmp_path / "r").exists()  # nothing half-written


def _start_node0(run_dir: Path, port: int, token: str, *extra: str, base=SMALL) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json",
           "--nnodes", "2", "--node-rank", "0", "--port", str(port), "--token", token, *base, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_wrong_token_is_refused_and_sigterm_reaps_everything(tmp_path):
    """Also: a node that runs another training script than node 0 refuses to join (issue 17)."""
    node0, port = start_leader(lambda p: _start_node0(tmp_path / "r", p, "right-token"))
    try:
        time.sleep(1.0)
        other = run_cli(tmp_path / "other", "--nnodes", "2", "--node-rank", "1", "--port", str(port),
                        "--token", "right-token", "--world-size", "4", EXAMPLE, timeout=60, check=False)
        assert other.returncode == 2 and "run the same script on every node" in other.stderr, other.stderr[-1000:]
        assert "Traceback" not in other.stderr
        p = run_cli(tmp_path / "r", *SMALL, "--nnodes", "2", "--node-rank", "1", "--port", str(port),
                    "--token", "wrong-token", timeout=60, check=False)
        assert p.returncode == 2 and "wrong join token" in p.stderr
    finally:
        node0.send_signal(signal.SIGTERM)
        t0 = time.time()
        node0.wait(timeout=10)
        assert time.time() - t0 < 5
        time.sleep(0.3)
        assert _procs_of((tmp_path / "r").resolve()) == []
    refused = [e["fields"] for e in events(tmp_path / "r") if e["kind"] == "join_refused"]
    assert [(f["node"], "tutorial_unbroken.py" in f["why"]) for f in refused] == [(1, True), (1, False)]


def test_two_nodes_train_together_and_recover_a_rank_on_node_1(tmp_path):
    """Also the join door (issue 14): a wrong token costs node 1 one attempt, not its place;
    the right one (from a 0600 --token-file) then joins. Each node has its own run directory,
    as on two machines: node 1's events reach node 0's summary, and node 1 gets the same summary."""
    run_dir, run_dir1 = tmp_path / "r", tmp_path / "r1"
    good = tmp_path / "token"
    good.write_text("tok\n")
    good.chmod(0o600)
    kill = ("--inject", "sigkill:rank=3,step=4,phase=optimizer,chunk=1")
    node0, port = start_leader(lambda p: _start_node0(run_dir, p, "tok", *kill))
    try:
        time.sleep(1.0)
        two = [*SMALL, "--nnodes", "2", "--node-rank", "1", "--port", str(port)]
        bad = run_cli(tmp_path / "bad", *two, "--token", "wrong-token", timeout=60, check=False)
        assert bad.returncode == 2 and "wrong join token" in bad.stderr, bad.stderr[-1000:]
        p1 = run_cli(run_dir1, *two, "--token-file", str(good), *kill, timeout=240, check=False)
        out, err = node0.communicate(timeout=240)
    finally:
        reap([node0])
    assert node0.returncode == 0, err[-2000:]
    assert p1.returncode == 0, p1.stderr[-2000:]
    summary = json.loads(out)
    assert summary["ranks_agree"] and summary["ok"], summary
    [rec] = summary["recoveries"]
    assert rec["rank"] == 3 and rec["path"] == "tier1"  # measured from node 1's events, handed to node 0
    assert json.loads(p1.stdout) == summary == json.loads((run_dir1 / "summary.json").read_text())
    assert (run_dir / "events-node1.jsonl").exists() and not (run_dir1 / "weights.pt").exists()
    ref = run_job(tmp_path / "ref", *SMALL)
    assert summary["weights_sha256"] == ref["weights_sha256"]
    assert _procs_of(run_dir.resolve()) == [] and _procs_of(run_dir1.resolve()) == []
    evs = events(run_dir)
    [refused] = [e for e in evs if e["kind"] == "join_refused"]
    assert refused["fields"]["node"] == 1 and refused["fields"]["retry_after_s"] > 0
    [joined] = [e for e in evs if e["kind"] == "node_joined"]
    assert joined["fields"]["attempt"] == 2 and joined["fields"]["failures"] == 1
    assert "not authenticated or encrypted" in " ".join(err.split())  # multi-node over TCPStore says so


@pytest.mark.slow
def test_a_persistent_straggler_on_node_1_gets_the_node_excluded(tmp_path):
    """Replace-class fault on a node that can go: exclude it, move its ranks, continue (tier 2)."""
    run_dir = tmp_path / "r"
    cfg = tmp_path / "job.toml"
    cfg.write_text("straggler_window_steps = 3\ncheckpoint_every = 2\n")
    args = [*SMALL, "--config", str(cfg)]
    args[args.index("--steps") + 1] = "16"
    slow = ("--inject", "slow:rank=3,step=2,phase=forward,ms=600")
    node0, port = start_leader(lambda p: _start_node0(run_dir, p, "tok", *slow, base=args))
    time.sleep(1.0)  # node 0 creates the run directory first
    # node 1 leaves early (excluded) while node 0 trains on: both are waited for before the
    # leftover-process check, which looks at every process of the shared run directory
    node1 = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress",
                              "--json", *args, "--nnodes", "2", "--node-rank", "1", "--port", str(port),
                              "--token", "tok", *slow], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = node0.communicate(timeout=240)
        _, err1 = node1.communicate(timeout=60)
    finally:
        reap([node0, node1])
    assert node0.returncode == 0, err[-2000:]
    assert node1.returncode == 0, err1[-2000:]
    assert _procs_of(run_dir.resolve()) == []
    summary = json.loads(out)
    assert summary["ok"]
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "node_excluded" and e["fields"]["node"] == 1 for e in evs)
    classified = [e for e in evs if e["kind"] == "fault_classified" and e["fields"]["fault"] == "straggler"]
    assert classified and classified[0]["fields"]["action"] == "exclude_node"
    gens = [e for e in evs if e["kind"] == "generation"]
    last = gens[-1]["fields"]["members"]
    assert all(not last[r].startswith("n1-") for r in ("2", "3"))  # both of node 1's ranks moved
    ref = run_job(tmp_path / "ref", *args)
    assert summary["weights_sha256"] == ref["weights_sha256"]
