"""Marks for tests that need CUDA: collected everywhere (`pytest -m gpu`), skipped with the reason."""
from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0

GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA: torch.cuda.is_available() is False here")]


def gpus(n: int) -> list:
    """Marks for a test of NCCL with `n` ranks: one rank per GPU, so `n` GPUs."""
    return [*GPU, pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs (NCCL runs one rank per GPU), {GPUS} visible")]
