"""Bring your own loop: the user's optimizer, scheduler, data and model mean the same under unbroken.

The same script (scripts/byo_equiv.py) runs under torchrun with plain DDP and under
`unbroken run`: per-step losses and final weights (BatchNorm buffers included) agree within
1e-6, and under unbroken two kills leave the final weights bit for bit as without them.
Why a tolerance at all: DDP divides each gradient by the world size before its bucketed
sum, unbroken sums then divides, in other buckets; clip norms are computed over other
groupings. Those change the last bits of a gradient (float32, ~6e-8 relative), a few
ulps of the weights over 16 steps; 1e-6 leaves room for that and still fails on any real
difference (a wrong group lr or beta is ~1e-3 after one step).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unbroken.bench import adoption
from unbroken.bench.adoption import run_torchrun

from .conftest import events, run_cli, run_job

pytestmark = pytest.mark.timeout(420)
SCRIPTS = Path(__file__).parent / "scripts"
EQUIV = str(SCRIPTS / "byo_equiv.py")
TOL = 1e-6
KILLS = ["--inject", "sigkill:rank=1,step=5,phase=backward", "--inject", "sigkill:rank=3,step=11,phase=midchunk"]
FAST = ["adamw_amsgrad"]
SLOW = ["sgd", "sgd_nesterov", "adam", "rmsprop_centered", "adagrad"]


def _plain(tmp_path: Path, optimizer: str) -> tuple[list[float], dict]:
    run_torchrun(EQUIV, ["--optimizer", optimizer, "--out", str(tmp_path / "plain.json"), "--weights",
                         str(tmp_path / "plain.pt")], tmp_path / "plain.log", tmp_path)
    return json.loads((tmp_path / "plain.json").read_text())["losses"], torch.load(tmp_path / "plain.pt")


@pytest.mark.parametrize("optimizer", FAST + [pytest.param(o, marks=pytest.mark.slow) for o in SLOW])
def test_same_script_under_torchrun_and_unbroken(tmp_path, optimizer):
    losses, weights = _plain(tmp_path, optimizer)
    args = ["--world-size", "4", EQUIV, "--optimizer", optimizer]
    clean = run_job(tmp_path / "ub", *args, "--out", str(tmp_path / "ub.json"))
    killed = run_job(tmp_path / "killed", *KILLS, *args, "--out", str(tmp_path / "killed.json"))
    mine = json.loads((tmp_path / "ub.json").read_text())["losses"]
    assert len(mine) == len(losses) == 16
    assert max(abs(a - b) for a, b in zip(mine, losses)) <= TOL, (mine, losses)
    ours = torch.load(tmp_path / "ub" / "weights.pt")
    assert set(ours) == set(weights)  # parameters, the frozen one, BatchNorm's buffers
    for name, t in weights.items():
        assert (ours[name].double() - t.double()).abs().max() <= TOL, f"{name} differs from plain DDP"
    assert len(killed["recoveries"]) == 2 and not killed["faults_not_fired"]
    assert killed["weights_sha256"] == clean["weights_sha256"]
    theirs = torch.load(tmp_path / "killed" / "weights.pt")
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)  # buffers too, bit for bit


@pytest.mark.parametrize("port", adoption.PORTS, ids=[p.name for p in adoption.PORTS])
def test_shipped_port_changes_few_lines_and_means_the_same(tmp_path, port):
    r = adoption.measure(port, tmp_path)
    assert r["changed_lines"] <= 10, r
    assert r["max_abs_diff"] <= (1e-6 if port.name == "tutorial" else 2e-4), r  # Adam: see docs/design.md
    assert r["bitwise_after_kills"] and r["recoveries_after_kills"] == 2 and r["ok"], r


def test_unreplayable_input_is_a_loud_event_not_a_silent_success(tmp_path):
    """A script that reads a stateful iterator: after a tier-2 rollback the redone steps see
    other batches. unbroken cannot replay that, and must say so."""
    args = ["--world-size", "4", "--checkpoint-every", "4",
            # two ranks of one parity group at once: tier 1 cannot decode, tier 2 rolls back to step 8
            "--inject", "sigkill:rank=0,step=10,phase=backward", "--inject", "sigkill:rank=1,step=10,phase=backward",
            EQUIV, "--optimizer", "sgd", "--stateful-data"]
    summary = run_job(tmp_path / "r", *args, "--out", str(tmp_path / "r.json"))
    found = [e for e in events(tmp_path / "r") if e["kind"] == "nondeterministic_input"]
    assert found and {e["fields"]["step"] for e in found} >= {9}
    assert summary["warnings"] and "nondeterministic input" in summary["warnings"][0]


@pytest.mark.parametrize("flag,needle", [
    ("--no-optimizer", "pass the torch.optim optimizer"),
    pytest.param("--foreign-optimizer", "not parameters of the model", marks=pytest.mark.slow),
    pytest.param("--foreign-scheduler", "built for another optimizer", marks=pytest.mark.slow),
    pytest.param("--accumulation-steps=0", "accumulation_steps must be an integer >= 1", marks=pytest.mark.slow),
    ("--tiny-dataset", "fewer than one global batch"),
    pytest.param("--lbfgs", "use one of SGD, Adam, AdamW, RMSprop, Adagrad", marks=pytest.mark.slow),
    pytest.param("--steps-disagree", "disagrees with --steps 3", marks=pytest.mark.slow),
    pytest.param("--meta-model", "is on meta, but this rank trains on cpu", marks=pytest.mark.slow),
])
def test_bad_use_is_a_one_line_error_exit_2(tmp_path, flag, needle):
    steps = ["--steps", "3"] if flag == "--steps-disagree" else []
    p = run_cli(tmp_path / "r", "--world-size", "2", *steps, str(SCRIPTS / "byo_bad.py"), flag, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_global_rng_dropout_tied_bf16_accumulation_replay_bitwise_after_kills(tmp_path):
    script = str(SCRIPTS / "byo_global_rng.py")
    clean = run_job(tmp_path / "clean", "--world-size", "4", script)
    killed = run_job(tmp_path / "killed", "--world-size", "4", "--inject", "sigkill:rank=0,step=4,phase=backward",
                     "--inject", "sigkill:rank=2,step=9,phase=allgather", script)
    assert clean["ok"] and clean["steps"] == 12 and len(killed["recoveries"]) == 2
    assert killed["weights_sha256"] == clean["weights_sha256"]
    a, b = torch.load(tmp_path / "clean" / "weights.pt"), torch.load(tmp_path / "killed" / "weights.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["emb.weight"], a["head.weight"])  # still tied
    assert not killed["warnings"]
