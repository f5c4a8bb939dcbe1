"""--collectives static|adaptive: the gradient all-reduce of ddp/zero1 on our patterns, recovery included."""
from __future__ import annotations

import pytest

from .conftest import SMALL, events, run_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _buckets(tmp_path, kb: int) -> list[str]:
    """Flags for gradient buckets of `kb` KiB issued during backward: a config file with `--overlap on`
    (agreed by construction; a plan file makes a member that joins later agree alone)."""
    cfg = tmp_path / "buckets.toml"
    cfg.write_text(f"bucket_kb = {kb}\n")
    return ["--config", str(cfg), "--overlap", "on"]


@pytest.mark.parametrize("strategy,bucket_kb,fault", [("ddp", None, "crash"), ("zero1", 16, "crash"),
                                                     ("zero1", 16, "hang")])
def test_a_failed_rank_recovers_to_the_failure_free_weights_with_adaptive_collectives(tmp_path, strategy, bucket_kb,
                                                                                      fault):
    """zero1 in small buckets: the rank dies while survivors' buckets are queued on our thread. A stopped
    rank (hang) leaves the survivors waiting inside gloo (buckets under learn_bytes are not timed:
    comm/transport.py) until it is detected and killed (test_comm_untimed_wait: a newer generation
    ends such a wait while the stalled peer's links stay up)."""
    args = [*SMALL, "--strategy", strategy, "--collectives", "adaptive", "--checkpoint-every", "2"]
    if bucket_kb is not None:
        args += _buckets(tmp_path, bucket_kb)
    free = run_job(tmp_path / "free", *args)
    assert free["ok"] and free["ranks_agree"]
    kind = {"crash": "sigkill", "hang": "sigstop"}[fault]
    got = run_job(tmp_path / "failed", *args, "--inject", f"{kind}:rank=1,step=5,phase=backward")
    assert got["ok"] and got["weights_sha256"] == free["weights_sha256"]
    assert [r["fault"] for r in got["recoveries"]] == [fault]  # one recovery: no hang after it


def test_static_and_adaptive_collectives_train_to_the_same_bits(tmp_path):
    """Both use the same reduction order (comm/patterns.py), whatever pattern the adaptive one picks
    and however the gradient is cut: static all-reduces it whole after backward (--overlap off),
    adaptive in small buckets issued during backward (comm/bucketed.py)."""
    args = [*SMALL, "--strategy", "ddp"]
    static = run_job(tmp_path / "static", *args, "--collectives", "static", "--overlap", "off")
    adaptive = run_job(tmp_path / "adaptive", *args, "--collectives", "adaptive", *_buckets(tmp_path, 16))
    assert static["weights_sha256"] == adaptive["weights_sha256"]
    assert not [e for e in events(tmp_path / "static") if e["kind"] == "collective_plan"]  # static never re-plans
    timeline = [e for e in events(tmp_path / "adaptive") if e["kind"] == "overlap_timeline"]
    assert timeline and len(timeline[0]["fields"]["buckets"]) > 3  # several buckets, issued while backward ran
