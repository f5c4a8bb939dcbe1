"""--collectives chain (and static): buckets during backward, a kill, and the bits of the static ring.

Also the regression test of a mismatch found with the chain: survivors redoing the step (their
gradient kept) all-reduced it whole while the new member issued its buckets, and gloo aborted
the new member on the first message of the wrong size. Now every path issues the same buckets."""
from __future__ import annotations

import pytest

from .conftest import SMALL, run_job

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("collectives", ["chain", pytest.param("static", marks=pytest.mark.slow)])  # static: test_collectives_job kills a rank under adaptive (same patterns code)
def test_buckets_with_a_kill_equal_the_static_ring_whole(tmp_path, collectives):
    """Reference: static, the whole gradient after backward, no failure. Then 16 KiB buckets issued
    while backward runs, and rank 1 killed at step 5. Same reduction order, so the same bits."""
    cfg = tmp_path / "buckets.toml"
    cfg.write_text("bucket_kb = 16\n")
    args = [*SMALL, "--strategy", "ddp", "--checkpoint-every", "2"]
    static = run_job(tmp_path / "static", *args, "--collectives", "static", "--overlap", "off")
    chain = run_job(tmp_path / f"{collectives}-killed", *args, "--collectives", collectives, "--config", str(cfg), "--overlap", "on",
                    "--inject", "sigkill:rank=1,step=5,phase=backward")
    assert static["ok"] and chain["ok"] and chain["ranks_agree"]
    assert chain["weights_sha256"] == static["weights_sha256"]
    assert [r["fault"] for r in chain["recoveries"]] == ["crash"]
    assert chain["steps_lost"] == 0
