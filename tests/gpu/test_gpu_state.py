"""State on the GPU: flat buffers where the model is, a CPU model refused under nccl, and the
tier-2 snapshot staged through pinned host memory by an async copy on a side stream."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unbroken.parallel.flat import FlatModel
from unbroken.protect.staging import HostStaging
from unbroken.protect.tier2 import CheckpointWriter, load_checkpoint
from unbroken.runtime.adopt import AdoptionError, check_device
from unbroken.runtime.devices import rank_device

from .need import GPU

pytestmark = GPU
KEY = bytes(range(32))


def _named(model: nn.Module) -> list:
    return list(model.named_parameters())


def test_flat_buffers_live_on_the_gpu_of_the_model():
    flat = FlatModel(_named(nn.Linear(8, 4).cuda()), world=2, chunk_elems=16, multiple=1, grad_slots=2)
    assert flat.device.type == "cuda"
    assert flat.params.device == flat.grads.device == flat.grads_of(1).device == flat.device


def test_a_cpu_model_is_refused_on_an_nccl_rank_naming_the_fix():
    with pytest.raises(AdoptionError, match=r"is on cpu, but this rank trains on cuda:0.*model.to\('cuda:0'\)"):
        check_device(_named(nn.Linear(3, 2)), rank_device("nccl", local_rank=0))
    check_device(_named(nn.Linear(3, 2).cuda(0)), rank_device("nccl", local_rank=0))


def test_staging_from_the_gpu_is_pinned_async_and_not_overwritten_by_later_kernels():
    src = {"params": torch.randn(1 << 20, device="cuda"), "step": torch.arange(7, device="cuda")}
    want = {k: v.cpu() for k, v in src.items()}
    staging = HostStaging()
    staging.copy(src)
    for v in src.values():
        v.add_(1)  # queued on the compute stream: must run after the copy has read the state
    got = staging.ready(timeout_s=30)
    for k in want:
        assert got[k].is_pinned() and got[k].equal(want[k])


def test_a_checkpoint_written_from_gpu_tensors_loads_bitwise(tmp_path):
    state = {"params": torch.randn(4096, device="cuda"), "exp_avg": torch.randn(4096, device="cuda")}
    w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id="run-gpu", key=KEY, strategy="ddp")
    w.save_async(1, 0, state)
    w.close()
    got, _ = load_checkpoint(tmp_path, 1, rank=0, world_size=1, run_id="run-gpu", key=KEY)
    for k, v in state.items():
        assert got[k].equal(v.cpu())
