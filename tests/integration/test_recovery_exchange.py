"""Recovery with XOR/AND by exchange (the path NCCL groups take), forced on gloo: the parity
build, the tier-1 decode and the tier-2 retention vote without BXOR/BAND, bitwise the same."""
from __future__ import annotations

import pytest

from .conftest import SMALL, events, run_job

pytestmark = pytest.mark.timeout(300)


# before the update: the decode stays in flight while the new member redoes its step (reduce_start);
# mid-update: the decode finishes at once (reduce)
@pytest.mark.parametrize("phase,chunk", [("backward", 0), ("midchunk", 2)])
def test_a_kill_recovers_bitwise_with_xor_and_by_exchange(tmp_path, reference, phase, chunk):
    cfg = tmp_path / "exchange.toml"
    cfg.write_text('bitwise_reduce = "exchange"\n')
    got = run_job(tmp_path / "run", *SMALL, "--config", str(cfg), "--strategy", "zero1", "--checkpoint-every", "2",
                  "--protect-every", "1", "--inject", f"sigkill:rank=2,step=4,phase={phase},chunk={chunk}")
    assert got["ok"] and got["ranks_agree"]
    assert got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    [rec] = got["recoveries"]
    assert rec["complete"] and rec["path"] == "tier1"
    built = [e["fields"] for e in events(tmp_path / "run") if e["kind"] == "parity_built"]
    assert built and {b["xor"] for b in built} == {"exchange"}
