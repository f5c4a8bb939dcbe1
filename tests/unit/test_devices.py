"""Backend choice and rank devices (runtime/devices.py), and how bad input is refused: one line, exit 2."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from unbroken.cli import app
from unbroken.config import ConfigError, RunConfig, build_config
from unbroken.runtime.devices import group_backend, rank_device, resolve_backend


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 16), nnodes=st.integers(1, 4), gpus=st.integers(0, 8), cuda=st.booleans())
def test_auto_is_nccl_exactly_when_cuda_is_available_and_nccl_needs_a_gpu_per_local_rank(world, nnodes, gpus, cuda):
    cfg = RunConfig(world_size=world, parity_group=world if world > 1 else 2)
    local = -(-world // nnodes)
    want = "nccl" if cuda else "gloo"
    if want == "nccl" and local > gpus:
        with pytest.raises(ConfigError, match=rf"{local} ranks per node exceed the {gpus} GPU\(s\).*--world-size "
                                               rf"{gpus * nnodes} or --backend gloo"):
            resolve_backend(cfg, nnodes=nnodes, cuda=cuda, gpus=gpus)
    else:
        assert resolve_backend(cfg, nnodes=nnodes, cuda=cuda, gpus=gpus).backend == want
    assert resolve_backend(cfg.replace(backend="gloo"), nnodes=nnodes, cuda=cuda, gpus=gpus).backend == "gloo"


def test_nccl_without_cuda_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"--backend nccl needs CUDA.*use --backend gloo"):
        resolve_backend(RunConfig(backend="nccl"), nnodes=1, cuda=False, gpus=0)


def test_the_rank_device_is_the_cpu_under_gloo_and_the_local_rank_gpu_under_nccl(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("gloo") == rank_device("auto") == torch.device("cpu")
    assert rank_device("nccl") == torch.device("cuda", 3)
    assert rank_device("nccl", local_rank=1) == torch.device("cuda", 1)
    assert (group_backend("nccl"), group_backend("gloo"), group_backend("auto")) == ("nccl", "gloo", "gloo")


def test_backend_and_bitwise_reduce_are_validated_and_read_from_toml(tmp_path):
    with pytest.raises(ConfigError, match="backend must be one of auto, gloo, nccl, got 'mpi'"):
        RunConfig(backend="mpi")
    with pytest.raises(ConfigError, match="bitwise_reduce must be one of auto, exchange, got 'native'"):
        RunConfig(bitwise_reduce="native")
    f = tmp_path / "job.toml"
    f.write_text('backend = "gloo"\nbitwise_reduce = "exchange"\n')
    cfg = build_config(f)
    assert (cfg.backend, cfg.bitwise_reduce) == ("gloo", "exchange")
    assert build_config(f, backend="nccl").backend == "nccl"  # the flag wins over the file


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
@pytest.mark.parametrize("args", [["run", "--backend", "nccl", "--steps", "2"],
                                  ["bench", "overhead", "--device", "cuda"],
                                  ["bench", "recovery", "--device", "cuda", "--quick"]])
def test_cuda_asked_for_on_a_host_without_it_is_one_line_exit_2(tmp_path, args):
    res = CliRunner().invoke(app, [*args, *(["--run-dir", str(tmp_path / "r")] if args[0] == "run" else [])])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0] and "Traceback" not in res.output
    assert not (tmp_path / "r").exists()  # nothing was started


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 16), gpus=st.integers(1, 8))
def test_device_cuda_takes_nccl_when_every_rank_has_a_gpu_else_gloo_with_the_ranks_sharing_them(world, gpus):
    cfg = RunConfig(world_size=world, parity_group=world if world > 1 else 2, device="cuda")
    got = resolve_backend(cfg, nnodes=1, cuda=True, gpus=gpus)
    assert (got.backend, got.device) == ("nccl" if world <= gpus else "gloo", "cuda")
    assert resolve_backend(cfg.replace(backend="gloo"), nnodes=1, cuda=True, gpus=gpus).backend == "gloo"
    cpu = resolve_backend(cfg.replace(device="cpu"), nnodes=1, cuda=True, gpus=gpus)
    assert (cpu.backend, cpu.device) == ("gloo", "cpu")  # auto never picks nccl for a CPU job


def test_devices_that_cannot_work_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"--device cuda needs CUDA.*use --device cpu"):
        resolve_backend(RunConfig(device="cuda"), nnodes=1, cuda=False, gpus=0)
    with pytest.raises(ConfigError, match=r"backend nccl moves CUDA tensors, but device is cpu; use --device cuda"):
        RunConfig(backend="nccl", device="cpu")
    with pytest.raises(ConfigError, match=r"device must be one of auto, cpu, cuda, got 'tpu'"):
        RunConfig(device="tpu")
    with pytest.raises(ConfigError, match=r"fsdp on CUDA .* need NCCL; use --backend nccl"):
        resolve_backend(RunConfig(device="cuda", backend="gloo", strategy="fsdp"), nnodes=1, cuda=True, gpus=1)
    with pytest.raises(ConfigError, match=r"collectives 'adaptive' runs on gloo with CPU tensors.*--device cpu"):
        RunConfig(device="cuda", collectives="adaptive")


def test_ranks_sharing_gpus_under_gloo_take_local_rank_modulo_the_gpus(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device("gloo", device="cuda") == torch.device("cuda", 1)
    assert rank_device("gloo", local_rank=4, device="cuda") == torch.device("cuda", 0)
    assert rank_device("nccl", device="cuda") == torch.device("cuda", 3)  # nccl: one GPU per rank, no wrap
    assert rank_device("gloo", device="cpu") == rank_device("gloo") == torch.device("cpu")


def test_run_device_cuda_on_a_host_without_cuda_is_one_line_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a host without CUDA")
    res = CliRunner().invoke(app, ["run", "--device", "cuda", "--steps", "2", "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--device cuda needs CUDA" in res.output and not (tmp_path / "r").exists()
