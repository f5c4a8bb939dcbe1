"""Host staging of tier-2 snapshots (protect/staging.py) on the CPU: the same path a GPU's takes,
without a stream. The CUDA branch (pinned buffers, side stream) is in tests/gpu/."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.protect.staging import HostStaging, StagingTimeout
from unbroken.protect.tier2 import CheckpointWriteError, CheckpointWriter

KEY = bytes(range(32))
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.float64]


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999))
def test_staged_bytes_equal_the_source_at_the_copy_and_do_not_follow_later_writes(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    src = {f"t{i}": torch.randint(0, 100, tuple(s), generator=g).to(dtype) for i, s in enumerate(shapes)}
    want = {k: v.clone() for k, v in src.items()}
    staging = HostStaging()
    staging.copy(src)
    for v in src.values():
        v.add_(1)  # the training thread moves on
    got = staging.ready(timeout_s=5)
    assert set(got) == set(want)
    for k in want:
        assert got[k].device.type == "cpu" and got[k].dtype == want[k].dtype
        assert got[k].shape == want[k].shape
        assert got[k].reshape(-1).view(torch.uint8).equal(want[k].reshape(-1).view(torch.uint8))


def test_buffers_are_reused_while_shapes_stay_and_replaced_when_they_change():
    staging = HostStaging()
    staging.copy({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)})
    a, b = staging.buffers["a"].data_ptr(), staging.buffers["b"].data_ptr()
    staging.copy({"a": torch.ones(4), "b": torch.ones(3, dtype=torch.int64)})
    assert staging.buffers["a"].data_ptr() == a and staging.buffers["a"].equal(torch.ones(4))
    assert staging.buffers["b"].shape == (3,) and staging.buffers["b"].data_ptr() != b


class _NeverLands(HostStaging):
    def ready(self, timeout_s: float) -> dict:
        raise StagingTimeout(f"the device-to-host copy of a snapshot did not finish within {timeout_s:.1f}s")


def test_the_writer_waits_for_the_staged_copy_and_surfaces_a_copy_that_never_lands(tmp_path):
    w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id="run-a", key=KEY, strategy="ddp", wait_timeout=0.5)
    w._staging = _NeverLands()
    w.save_async(1, 0, {"p": torch.ones(3)})
    with pytest.raises(CheckpointWriteError, match="did not finish within 0.5s"):
        w.wait(5)
    assert 1 not in w.committed_steps()
