"""Which backend a job's data collectives use and which device each rank trains on.

`auto` is resolved once, at launch, so that every process of the job reads the same
concrete backend and device from config.json: nccl when CUDA is available, else gloo; the
device follows the backend unless given. nccl runs one rank per GPU on the rank's LOCAL_RANK
slot. gloo trains on the CPU, or with `--device cuda` on GPUs that several ranks may share
(LOCAL_RANK modulo the GPUs visible): NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so such ranks stage their collectives through host memory (comm/staged.py).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from unbroken.config import ConfigError, RunConfig


def resolve_backend(cfg: RunConfig, *, nnodes: int, cuda: bool | None = None, gpus: int | None = None) -> RunConfig:
    """cfg with `auto` replaced; ConfigError (one line, naming the fix) for a backend this host cannot run.
    `cuda` and `gpus` default to what torch sees here."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    gpus = (torch.cuda.device_count() if cuda else 0) if gpus is None else gpus
    local = -(-cfg.world_size // nnodes)
    backend = cfg.backend
    if backend == "auto":  # nccl where it can run; ranks asked onto fewer GPUs than they are share them on gloo
        backend = "nccl" if cuda and cfg.device != "cpu" and (cfg.device == "auto" or local <= gpus) else "gloo"
    if backend == "nccl":
        if not cuda:
            raise ConfigError("--backend nccl needs CUDA, but torch.cuda.is_available() is False on this host; "
                              "use --backend gloo (or auto)")
        if local > gpus:
            raise ConfigError(f"--backend nccl runs one rank per GPU, but {local} ranks per node exceed the {gpus} "
                              f"GPU(s) visible here; use --world-size {gpus * nnodes} or --backend gloo "
                              "(with --device cuda the ranks share the GPUs)")
    device = device_kind(backend, cfg.device)
    if device == "cuda" and not cuda:
        raise ConfigError("--device cuda needs CUDA, but torch.cuda.is_available() is False on this host; "
                          "use --device cpu (or auto)")
    if device == "cuda" and backend == "gloo" and cfg.strategy == "fsdp":
        raise ConfigError("--strategy fsdp on CUDA runs FSDP2's own collectives, which need NCCL; use --backend "
                          "nccl (one rank per GPU) or --device cpu")
    if (backend, device) == (cfg.backend, cfg.device):
        return cfg
    return dataclasses.replace(cfg, backend=backend, device=device)


def device_kind(backend: str, device: str = "auto") -> str:
    """"cpu" or "cuda": `device`, or for auto the backend's (cuda under nccl, else cpu)."""
    return device if device != "auto" else ("cuda" if backend == "nccl" else "cpu")


def rank_device(backend: str, local_rank: int | None = None, device: str = "auto") -> torch.device:
    """The device a rank trains on: the CPU, its LOCAL_RANK GPU under nccl, or under gloo with device
    cuda the GPU LOCAL_RANK modulo the GPUs visible (ranks share them)."""
    if device_kind(backend, device) == "cpu":
        return torch.device("cpu")
    slot = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if backend != "nccl":
        slot %= max(1, torch.cuda.device_count())
    return torch.device("cuda", slot)


def bind_rank_device(backend: str, device: str = "auto") -> torch.device:
    """Make the rank's device current (CUDA: torch.cuda.set_device, as torchrun scripts do) and return it."""
    device = rank_device(backend, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def group_backend(backend: str) -> str:
    """The Comm backend for a config's (resolved) backend; an unresolved auto means gloo."""
    return "nccl" if backend == "nccl" else "gloo"
