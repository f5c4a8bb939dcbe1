"""What the zero3 and fsdp recovery tests share: a kill at every stage of a step (PHASES), the
small job run with one strategy and its faults, and the events read back."""
from __future__ import annotations

from pathlib import Path

from .conftest import SMALL, events, run_job

# before the update, and inside it while no parity window has absorbed it (survivors roll back
# to their snapshots): the step is redone by every rank (the new member decodes its shard first:
# its forward gathers from it, and from every other rank); at the all-gather phase every update
# is done: decoded at step 5; once a window was absorbed (phase parity, window 1: window 0's
# all-to-all may have completed) no copy of the lost shard's step-4 values is left: tier 2
PHASES = [("forward", 0, "tier1"), ("backward", 0, "tier1"), ("allreduce", 0, "tier1"), ("reduced", 0, "tier1"),
          ("optimizer", 0, "tier1"), ("midchunk", 2, "tier1"), ("parity", 1, "either"), ("allgather", 0, "tier1")]


def run_strategy(tmp_path, name, strategy, *injects, extra=()):
    args = [*SMALL, "--strategy", strategy, "--checkpoint-every", "2", *extra]
    for spec in injects:
        args += ["--inject", spec]
    return run_job(tmp_path / name, *args)


def kinds(run_dir, kind):
    return [e["fields"] for e in events(Path(run_dir)) if e["kind"] == kind]


def only_recovery(run_dir) -> dict:
    """The run's one `recovered` event; when there are more, the failure names each generation's
    cause and each detected fault (a second recovery under load is then diagnosable from the CI log)."""
    recs = kinds(run_dir, "recovered")
    if len(recs) != 1:
        why = [(e["kind"], e.get("gen"), e.get("rank"), {k: e["fields"].get(k) for k in ("cause", "fault", "proc")})
               for e in events(Path(run_dir)) if e["kind"] in ("generation", "fault_detected", "recovered")]
        raise AssertionError(f"{len(recs)} recoveries, expected 1: {why}")
    return recs[0]


def losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in kinds(run_dir, "step")}


def kill_at_phase_is_invisible(tmp_path, strategy: str, reference_sha: str, phase: str, chunk: int, path: str):
    """SIGKILL rank 2 at `phase` of step 5: the weights equal the failure-free run's, and the
    recovery took the path PHASES names (tier 1 with the step redone by every rank, whose
    forward gathers from all of them; or decoded at step 5 once every update was done)."""
    got = run_strategy(tmp_path, "run", strategy, f"sigkill:rank=2,step=5,phase={phase},chunk={chunk}")
    assert got["ok"] and got["ranks_agree"] and got["weights_sha256"] == reference_sha
    restored = {e["step"] for e in kinds(tmp_path / "run", "tier2_restore")}
    if path == "either" and restored:
        assert restored == {4}
        return
    rec = only_recovery(tmp_path / "run")
    assert rec["path"] == "tier1" and rec["replaced"] == [2] and got["steps_lost"] == 0
    if phase == "allgather":  # every update was done (and the commit has no collective):
        assert rec["step"] == 5  # the survivors committed step 5, the lost shard is decoded at 5
        return
    if phase == "allreduce" and rec["step"] == 5:  # its reduce-scatter may have completed
        return
    assert (rec["step"], rec["steps_redone"], rec["recompute_ranks"]) == (4, 1, [0, 1, 2, 3])
