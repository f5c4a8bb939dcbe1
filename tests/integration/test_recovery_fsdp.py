"""fsdp (PyTorch's FSDP2 `fully_shard` under unbroken's protection): ddp's per-step losses within
float tolerance and bitwise reproducible with itself; a kill at any stage of a step ends with
weights bitwise equal to the failure-free fsdp run (tier 1, or tier 2 where no copy is left)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .sharded_runs import PHASES, kill_at_phase_is_invisible, kinds as _kinds, losses as _losses, run_strategy

pytestmark = pytest.mark.timeout(300)

# zero3's paths (fsdp's state is zero3's, in FSDP2's layout), sharded_runs.PHASES
DEFAULT = {"backward"}  # the rest with -m slow


def _run(tmp_path, name, *injects, extra=()):
    return run_strategy(tmp_path, name, "fsdp", *injects, extra=extra)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    return {**_run(root, "ref"), "run_dir": str(root / "ref")}


def test_fsdp_has_ddps_losses_and_weights_within_float_tolerance(fsdp, reference):
    ddp = reference["ddp"]
    assert fsdp["ok"] and fsdp["strategy"] == "fsdp" and fsdp["ranks_agree"] and fsdp["steps"] == ddp["steps"]
    mine, theirs = _losses(fsdp["run_dir"]), _losses(ddp["run_dir"])
    assert mine.keys() == theirs.keys() and len(mine) == 8
    for step, loss in mine.items():
        assert math.isclose(loss, theirs[step], rel_tol=1e-5), step
    # the weights file holds the full (gathered) tensors, under the model's own names
    w, ref = (torch.load(Path(r["run_dir"]) / "weights.pt") for r in (fsdp, ddp))
    assert w.keys() == ref.keys()
    for name, t in w.items():
        assert type(t) is torch.Tensor and t.shape == ref[name].shape
        assert torch.allclose(t, ref[name], atol=1e-4), name
    # ... after the last update (FSDP2's own copy is refreshed only before a forward), and hashed
    from unbroken.runtime.export import flat_sha256, load_layout

    assert flat_sha256([w[n] for n, _ in load_layout(fsdp["run_dir"])["params"]]) == fsdp["weights_sha256"]
    # a tier-2 checkpoint (FSDP2's slots per rank) exports to the same tensors as the weights file
    from unbroken.runtime.export import checkpoint_step, state_dict_from_checkpoint

    assert checkpoint_step(fsdp["run_dir"]) == 8
    exported = state_dict_from_checkpoint(fsdp["run_dir"])
    assert exported.keys() == w.keys() and all(torch.equal(exported[k], w[k]) for k in w)
    # the protection is zero3's structure: parity, snapshot and a one-slot gradient ring
    [parity] = _kinds(fsdp["run_dir"], "parity_built")[:1]
    assert parity["protect_every"] == 1 and parity["bytes"] > 0


@pytest.mark.parametrize("phase,chunk,path", [
    pytest.param(p, c, path, marks=() if p in DEFAULT else pytest.mark.slow) for p, c, path in PHASES])
def test_fsdp_sigkill_at_each_phase_is_bitwise_invisible(tmp_path, fsdp, phase, chunk, path):
    kill_at_phase_is_invisible(tmp_path, "fsdp", fsdp["weights_sha256"], phase, chunk, path)


@pytest.mark.slow
def test_fsdp_two_failures_and_a_run_again_are_bitwise_the_same(tmp_path, fsdp):
    got = _run(tmp_path, "two", "sigkill:rank=1,step=3,phase=backward", "sigkill:rank=3,step=6,phase=forward")
    assert got["weights_sha256"] == fsdp["weights_sha256"] and len(got["recoveries"]) == 2
    again = _run(tmp_path, "again")
    assert again["weights_sha256"] == fsdp["weights_sha256"]
    assert _losses(tmp_path / "again") == _losses(fsdp["run_dir"])


@pytest.mark.slow
def test_fsdp_two_losses_in_one_parity_group_restore_tier2_bitwise(tmp_path, fsdp):
    got = _run(tmp_path, "t2", "sigkill:rank=1,step=5,phase=backward", "sigkill:rank=2,step=5,phase=backward")
    assert got["ok"] and got["weights_sha256"] == fsdp["weights_sha256"]
    assert {e["step"] for e in _kinds(tmp_path / "t2", "tier2_restore")} == {4}


@pytest.mark.slow
def test_fsdp_world_two_recovers_bitwise(tmp_path):
    world2 = ["--world-size", "2"]
    ref = _run(tmp_path, "ref2", extra=world2)
    got = _run(tmp_path, "kill2", "sigkill:rank=1,step=3,phase=forward", extra=world2)
    assert got["weights_sha256"] == ref["weights_sha256"] and got["recoveries"]
