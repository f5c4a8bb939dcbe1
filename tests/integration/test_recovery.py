"""Kill, hang, corrupt: every run must end with weights bitwise equal to a failure-free run."""
from __future__ import annotations

import pytest

from .conftest import SMALL, events, run_job

pytestmark = pytest.mark.timeout(300)

# (K, step, phase, chunk): each stage of a step, including the middle of one chunk's update,
# with parity every step (K=1) and every 4th step (K=4: parity points 4 and 8), where the kill
# lands on a parity step (4), the first step after it (5) and inside the window (6, 7)
ZERO1_POINTS = [(1, 4, "backward", 0), (1, 4, "midchunk", 2), (1, 4, "parity", 1), (1, 4, "allgather", 0),
                (4, 5, "forward", 0), (4, 5, "optimizer", 3), (4, 6, "backward", 0), (4, 6, "allreduce", 0),
                (4, 7, "midchunk", 2), (4, 4, "optimizer", 0), (4, 4, "parity", 1), (4, 4, "allgather", 0)]


def _faulted(tmp_path, strategy, *injects, extra=()):
    args = [*SMALL, "--strategy", strategy, "--checkpoint-every", "2", *extra]
    for spec in injects:
        args += ["--inject", spec]
    return run_job(tmp_path / "run", *args)


@pytest.mark.parametrize("k,step,phase,chunk", ZERO1_POINTS)
def test_zero1_sigkill_at_each_phase_is_bitwise_invisible(tmp_path, reference, k, step, phase, chunk):
    got = _faulted(tmp_path, "zero1", f"sigkill:rank=2,step={step},phase={phase},chunk={chunk}",
                   extra=("--protect-every", str(k)))
    assert got["ok"] and got["ranks_agree"]
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    [rec] = got["recoveries"]
    assert rec["complete"] and rec["path"] in ("tier1", "initial")
    assert got["steps_lost"] == 0
    [ev] = _recovered(tmp_path)
    # before the update the step is redone, from it on rolled forward; the lost shard is decoded
    # at the last parity point (the interrupted one if its all-gather was reached) and replayed
    target = step - 1 if phase in ("forward", "backward", "allreduce") else step
    oldest = step if (phase == "allgather" and step % k == 0) else (step - 1) // k * k
    expected = {(target, target - oldest)}
    if phase == "allreduce":  # the killed rank's last bucket may already be in its peers' hands:
        expected.add((step, step - oldest))  # they finish the all-reduce and commit the step
    assert (ev["step"], ev["steps_replayed"]) in expected


@pytest.mark.parametrize("phase", ["backward", "optimizer", "allgather"])
def test_ddp_sigkill_recovers_from_a_replica(tmp_path, reference, phase):
    got = _faulted(tmp_path, "ddp", f"sigkill:rank=1,step=5,phase={phase}")
    assert got["weights_sha256"] == reference["ddp"]["weights_sha256"]
    assert got["recoveries"][0]["path"] == "replica"


def test_kill_during_initial_parity_build(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=3,step=1,phase=build")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]


def test_sigstop_hang_is_detected_killed_and_recovered(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigstop:rank=1,step=4,phase=backward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    kinds = [(e["kind"], e["fields"].get("fault")) for e in events(tmp_path / "run")]
    assert ("fault_detected", "hang") in kinds
    assert any(k == "process_killed" for k, _ in kinds)


def test_two_failures_in_sequence(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=3,phase=optimizer", "sigkill:rank=0,step=6,phase=backward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assert len(got["recoveries"]) == 2


def _recovered(tmp_path) -> list[dict]:
    return [e["fields"] for e in events(tmp_path / "run") if e["kind"] == "recovered"]


def test_redo_recomputes_only_the_lost_rank_and_rebuilds_only_its_parity_rows(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=4,phase=backward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    [rec] = _recovered(tmp_path)
    assert rec["steps_redone"] == 1 and rec["recompute_ranks"] == [2]  # survivors kept their own gradient
    assert rec["parity_rebuilt"] == "lost rows"


def test_a_failure_mid_parity_step_rolls_forward_and_rebuilds_all_parity(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=4,phase=optimizer,chunk=12", extra=("--protect-every", "2"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    [rec] = _recovered(tmp_path)
    assert rec["steps_redone"] == 0 and rec["recompute_ranks"] == [] and rec["parity_rebuilt"] == "full"


def test_the_new_member_dies_while_redoing_the_step(tmp_path, reference):
    # the first shadow is killed in its backward, while its deferred decode is still pending
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=4,phase=forward", "sigkill:rank=2,step=4,phase=backward",
                   extra=("--shadows", "2"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assert len(got["recoveries"]) == 2
    assert all(r["parity_rebuilt"] == "lost rows" for r in _recovered(tmp_path))


def test_a_failure_mid_update_between_parity_points_keeps_the_parity(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=7,phase=optimizer,chunk=1", extra=("--protect-every", "4"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    [rec] = _recovered(tmp_path)
    # decoded at step 4, steps 5..7 replayed (6 from the log, 7 from the handed-off gradient)
    assert rec["step"] == 7 and rec["steps_redone"] == 0 and rec["parity_rebuilt"] == "lost rows"
    assert rec["steps_replayed"] > 0


def test_a_second_failure_during_the_replay_window(tmp_path, reference):
    # rank 1 dies at step 7; its replacement dies in its backward while its decode and the
    # gradient log of steps 5..6 are still in flight; the next shadow decodes and replays again
    got = _faulted(tmp_path, "zero1", "sigkill:rank=1,step=7,phase=forward", "sigkill:rank=1,step=7,phase=backward",
                   extra=("--protect-every", "4", "--shadows", "2"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assert len(got["recoveries"]) == 2
    assert [(r["step"], r["steps_replayed"]) for r in _recovered(tmp_path)] == [(6, 2), (6, 2)]


def test_dropped_links_regroup_the_same_processes(tmp_path, reference):
    # every gloo connection of a rank is shut down while all processes live on; twice
    got = _faulted(tmp_path, "zero1", "linkdrop:rank=2,step=3,phase=forward", "linkdrop:rank=1,step=6,phase=backward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"] and got["steps_lost"] == 0
    assert [(r["fault"], r["complete"]) for r in got["recoveries"]] == [("stall", True)] * 2
    evs = events(tmp_path / "run")
    assert not [e for e in evs if e["kind"] in ("process_killed", "shadow_assigned")]  # nobody replaced
    gens = [e["fields"] for e in evs if e["kind"] == "generation" and e["fields"]["gen"] > 0]
    assert [(g["replaced"], g["cause"]) for g in gens] == [([], "link")] * 2
    recovered = _recovered(tmp_path)
    assert len(recovered) == 2  # one reporter per recovery
    assert all(r["recompute_ranks"] == [] for r in recovered)  # every rank kept its own gradient


def test_failure_during_recovery(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=2,step=4,phase=optimizer,chunk=1",
                   "sigkill:rank=0,step=4,phase=recovery")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]


def test_shadow_dies_while_being_assigned(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=1,step=4,phase=optimizer", "sigkill:rank=1,step=1,phase=shadow",
                   extra=("--shadows", "2"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    evs = events(tmp_path / "run")
    assert [e["fields"]["phase"] for e in evs if e["kind"] == "fault_injected"] == ["optimizer", "shadow"]
    assert sum(1 for e in evs if e["kind"] == "shadow_assigned" and e["rank"] == 1) == 2


def test_python_exception_in_a_rank(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "exception:rank=3,step=5,phase=forward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assert any(e["kind"] == "fault_detected" and e["fields"]["fault"] == "exception" for e in events(tmp_path / "run"))


def test_nan_gradient_is_caught_and_the_step_redone(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "nan:rank=1,step=4,phase=backward")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assert got["recoveries"] == []
    assert any(e["kind"] == "numerics" and e["fields"]["step"] == 4 for e in events(tmp_path / "run"))


def test_two_losses_in_one_parity_group_fall_back_to_tier2(tmp_path, reference):
    # step 6's update never committed (killed before the all-gather); step 5 had: the newest
    # checkpoint is step 4 (or 2, if the killed ranks' step-4 files were cut short), so >= 1 is lost
    got = _faulted(tmp_path, "zero1", "sigkill:rank=1,step=6,phase=optimizer", "sigkill:rank=2,step=6,phase=optimizer",
                   extra=("--shadows", "2"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    restored = {e["fields"]["step"] for e in events(tmp_path / "run") if e["kind"] == "tier2_restore"}
    assert len(restored) == 1 and got["steps_lost"] == 5 - restored.pop() > 0


@pytest.mark.parametrize("kill_phase", ["optimizer", "backward"])  # full decode path; overlapped (deferred) path
def test_corrupted_parity_chunk_is_detected_and_tier2_used(tmp_path, reference, kill_phase):
    got = _faulted(tmp_path, "zero1", "bitflip:rank=1,step=5,phase=forward,chunk=0",
                   f"sigkill:rank=2,step=5,phase={kill_phase},chunk=0")
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    evs = events(tmp_path / "run")
    assert any(e["kind"] == "warning" and "checksum" in e["fields"]["message"] for e in evs)
    assert any(e["kind"] == "tier2_restore" for e in evs)


def test_without_shadows_a_cold_process_takes_over(tmp_path, reference):
    got = _faulted(tmp_path, "zero1", "sigkill:rank=1,step=4,phase=optimizer", extra=("--shadows", "0"))
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    assigned = [e for e in events(tmp_path / "run") if e["kind"] == "shadow_assigned"]
    assert [e["fields"]["cold"] for e in assigned] == [True]


def test_auto_interval_is_chosen_once_and_kills_stay_bitwise(tmp_path):
    # "auto" starts at K=8, takes K from the averaged measurements at step 9; kills before
    # and after the choice (the second new member must adopt the chosen K)
    args = (*SMALL, "--steps", "14", "--checkpoint-every", "2")
    plain = run_job(tmp_path / "plain", *args, "--protect-every", "1")
    got = run_job(tmp_path / "run", *args, "--protect-every", "auto", "--shadows", "2",
                  "--inject", "sigkill:rank=1,step=6,phase=backward", "--inject", "sigkill:rank=3,step=12,phase=optimizer")
    assert got["weights_sha256"] == plain["weights_sha256"] and len(got["recoveries"]) == 2
    [chosen] = [e["fields"] for e in events(tmp_path / "run") if e["kind"] == "protect_every_chosen"]
    assert chosen["step"] == 9 and 1 <= chosen["protect_every"] <= chosen["max_k"]


@pytest.mark.parametrize("strategy,path", [("ddp", "replica"), ("zero1", "tier1")])
def test_a_survivor_a_step_behind_is_never_the_source(tmp_path, reference, strategy, path):
    # rank 0 alone fails step 5's all-reduce after its peers completed it: they commit step 5,
    # rank 0 stays at 4, and the same members regroup; the lowest rank is the stale one
    got = _faulted(tmp_path, strategy, "collerr:rank=0,step=5,phase=reduced")
    assert got["weights_sha256"] == reference[strategy]["weights_sha256"] and got["ranks_agree"]
    assert [(r["fault"], r["complete"], r["path"]) for r in got["recoveries"]] == [("stall", True, path)]
    assert got["steps_lost"] == 0
    [rec] = _recovered(tmp_path)
    assert rec["step"] == 5 and rec["replaced"] == []


@pytest.fixture(scope="module")
def untiered(tmp_path_factory) -> tuple[list[str], dict]:
    """zero1 with tier 1 off (a config file: there is no flag) and its failure-free run."""
    root = tmp_path_factory.mktemp("untiered")
    (root / "tier1_off.toml").write_text("tier1 = false\n")
    args = [*SMALL, "--strategy", "zero1", "--checkpoint-every", "2", "--config", str(root / "tier1_off.toml")]
    return args, run_job(root / "plain", *args)


@pytest.mark.parametrize("inject,path", [("sigkill:rank=2,step=5,phase=optimizer", "tier2"),
                                         ("collerr:rank=0,step=5,phase=reduced", "local")])
def test_zero1_without_tier1_never_takes_a_peer_shard(tmp_path, untiered, inject, path):
    # a lost shard exists nowhere else: tier 2; a regroup of the same members replays in place
    args, plain = untiered
    got = run_job(tmp_path / "run", *args, "--inject", inject)
    assert got["weights_sha256"] == plain["weights_sha256"]
    assert got["recoveries"][-1]["complete"] and got["recoveries"][-1]["path"] == path
