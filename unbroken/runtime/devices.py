"""Which backend a job's data collectives use and which device each rank trains on.

`auto` is resolved once, at launch, so that every process of the job reads the same
concrete backend from config.json: nccl when CUDA is available, else gloo. nccl runs one
rank per GPU on the rank's LOCAL_RANK slot; gloo trains on the CPU.
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
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not cuda:
            raise ConfigError("--backend nccl needs CUDA, but torch.cuda.is_available() is False on this host; "
                              "use --backend gloo (or auto)")
        gpus = torch.cuda.device_count() if gpus is None else gpus
        local = -(-cfg.world_size // nnodes)
        if local > gpus:
            raise ConfigError(f"--backend nccl runs one rank per GPU, but {local} ranks per node exceed the {gpus} "
                              f"GPU(s) visible here; use --world-size {gpus * nnodes} or --backend gloo")
    return cfg if backend == cfg.backend else dataclasses.replace(cfg, backend=backend)


def rank_device(backend: str, local_rank: int | None = None) -> torch.device:
    """The device a rank of this backend trains on: its GPU slot under nccl, else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    slot = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return torch.device("cuda", slot)


def bind_rank_device(backend: str) -> torch.device:
    """Make the rank's device current (CUDA: torch.cuda.set_device, as torchrun scripts do) and return it."""
    device = rank_device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def group_backend(backend: str) -> str:
    """The Comm backend for a config's (resolved) backend; an unresolved auto means gloo."""
    return "nccl" if backend == "nccl" else "gloo"
