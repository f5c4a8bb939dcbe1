"""zero3 (parameters sharded, gathered per unit) under unbroken's protection: the same per-step
losses and bitwise the same final weights as zero2; a kill at any stage of a step ends with
weights bitwise equal to the failure-free run; its memory is below zero2's."""
from __future__ import annotations


import pytest

from .conftest import run_job
from .sharded_runs import PHASES, kill_at_phase_is_invisible, kinds as _kinds, losses as _losses, run_strategy

pytestmark = pytest.mark.timeout(300)

DEFAULT = {"backward", "allgather", "midchunk"}  # one per path; the rest with -m slow


def _run(tmp_path, name, *injects, strategy="zero3", extra=()):
    return run_strategy(tmp_path, name, strategy, *injects, extra=extra)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zero3")
    return {**_run(root, "ref"), "run_dir": str(root / "ref")}


def test_zero3_equals_zero2_bitwise(zero3, reference):
    z2 = reference["zero2"]
    assert zero3["ok"] and zero3["strategy"] == "zero3" and zero3["steps"] == z2["steps"]
    assert zero3["weights_sha256"] == z2["weights_sha256"]
    assert _losses(zero3["run_dir"]) == _losses(z2["run_dir"])


@pytest.mark.parametrize("phase,chunk,path", [
    pytest.param(p, c, path, marks=() if p in DEFAULT else pytest.mark.slow) for p, c, path in PHASES])
def test_zero3_sigkill_at_each_phase_is_bitwise_invisible(tmp_path, zero3, phase, chunk, path):
    kill_at_phase_is_invisible(tmp_path, "zero3", zero3["weights_sha256"], phase, chunk, path)


@pytest.mark.slow
def test_zero3_two_failures_and_a_run_again_are_bitwise_the_same(tmp_path, zero3):
    got = _run(tmp_path, "two", "sigkill:rank=1,step=3,phase=backward", "sigkill:rank=3,step=6,phase=forward")
    assert got["weights_sha256"] == zero3["weights_sha256"] and len(got["recoveries"]) == 2
    assert _run(tmp_path, "again")["weights_sha256"] == zero3["weights_sha256"]


def _done(run_dir) -> list[dict]:
    done = _kinds(run_dir, "worker_done")
    assert len(done) == 4
    return done


def test_zero3_holds_fewer_tensor_bytes_than_zero2_and_the_same_protection(zero3, reference):
    z3, z2 = _done(zero3["run_dir"]), _done(reference["zero2"]["run_dir"])
    assert max(d["tensor_bytes"] for d in z3) < min(d["tensor_bytes"] for d in z2)
    # the protection is zero2's: parity, snapshot and the one-slot gradient ring, byte for byte
    assert [d["protection_bytes"] for d in z3] == [d["protection_bytes"] for d in z2]


@pytest.mark.slow
def test_zero3_peak_rss_is_below_zero2s(tmp_path):
    """At world 4, on a model whose parameters (~0.8M, 3.2 MB) dwarf the processes' noise."""
    big = ["--n-layer", "4", "--n-embd", "128", "--steps", "3", "--world-size", "4", "--checkpoint-every", "0"]
    done = {}
    for s in ("zero2", "zero3"):
        run_job(tmp_path / s, *big, "--strategy", s)
        done[s] = _done(tmp_path / s)
    for key in ("peak_rss_bytes", "tensor_bytes"):
        assert max(d[key] for d in done["zero3"]) < min(d[key] for d in done["zero2"]), key
