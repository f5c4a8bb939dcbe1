"""Each fault class injected into a 4-rank run is detected, classified and acted on."""
from __future__ import annotations

import pytest

from .conftest import SMALL, events, run_job

pytestmark = pytest.mark.timeout(300)


def _decisions(run_dir):
    evs = events(run_dir)
    detected = [e for e in evs if e["kind"] == "fault_detected"]
    classified = [e for e in evs if e["kind"] == "fault_classified"]
    return evs, detected, classified


@pytest.mark.parametrize("spec,fault,killed", [
    ("sigkill:rank=1,step=4,phase=backward", "crash", False),
    ("sigstop:rank=2,step=4,phase=optimizer", "hang", True),
    ("exception:rank=3,step=4,phase=forward", "exception", False),
])
def test_process_faults_are_operable_and_recovered_in_place(tmp_path, spec, fault, killed):
    got = run_job(tmp_path / "r", *SMALL, "--inject", spec)
    assert got["ok"]
    evs, detected, classified = _decisions(tmp_path / "r")
    assert [d["fields"]["fault"] for d in detected] == [fault]
    assert classified[0]["fields"]["cls"] == "operable" and classified[0]["fields"]["action"] == "in_place"
    assert any(e["kind"] == "process_killed" for e in evs) == killed
    assert any(e["kind"] == "retry" and e["fields"]["outcome"] == "ok" for e in evs)
    [rec] = got["recoveries"]
    assert rec["complete"]


def test_nan_is_a_transient_numerics_fault_redone_in_place(tmp_path):
    got = run_job(tmp_path / "r", *SMALL, "--inject", "nan:rank=0,step=3,phase=backward")
    assert got["ok"] and got["recoveries"] == []
    _, detected, classified = _decisions(tmp_path / "r")
    assert detected[0]["fields"]["fault"] == "numerics"
    assert detected[0]["fields"]["evidence"]["what"] == "grad_nonfinite"
    assert classified[0]["fields"]["action"] == "in_place"


def test_persistent_straggler_is_classified_replace_and_swapped_for_a_shadow(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("straggler_window_steps = 3\n")
    args = [a for a in SMALL]
    args[args.index("--steps") + 1] = "16"
    got = run_job(tmp_path / "r", "--config", str(cfg), *args, "--inject", "slow:rank=2,step=2,phase=forward,ms=600")
    assert got["ok"] and got["ranks_agree"]
    evs, detected, classified = _decisions(tmp_path / "r")
    strag = [d for d in detected if d["fields"]["fault"] == "straggler"]
    assert strag and strag[0]["rank"] == 2
    assert strag[0]["fields"]["evidence"]["ratio"] >= 1.5
    c = [c for c in classified if c["fields"]["fault"] == "straggler"][0]
    assert c["fields"]["cls"] == "replace"
    # one node only: it cannot be excluded, so the straggling rank is replaced in place
    assert c["fields"]["action"] == "in_place"
    assert any(e["kind"] == "process_killed" and e["rank"] == 2 for e in evs)
    assert len(got["recoveries"]) == 1
