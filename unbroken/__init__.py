"""unbroken: keep PyTorch training productive while hardware fails.

Public API: `unbroken.Trainer` (inside a script launched by `unbroken run`),
`unbroken.current_config()`, `unbroken.device()`, `unbroken.RunConfig`, and the `unbroken` CLI.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from unbroken.config import ModelConfig, RunConfig

if TYPE_CHECKING:
    from unbroken.runtime.worker import Trainer

__all__ = ["ModelConfig", "RunConfig", "Trainer", "current_config", "device"]
__version__ = "0.1.0"


def current_config() -> RunConfig:
    """The RunConfig of the job this process belongs to (under `unbroken run`)."""
    import json
    import os
    from pathlib import Path

    run_dir = os.environ.get("UNBROKEN_RUN_DIR")
    if not run_dir:
        raise RuntimeError("not running under `unbroken run` (UNBROKEN_RUN_DIR is not set)")
    return RunConfig.from_dict(json.loads((Path(run_dir) / "config.json").read_text()))


def device():
    """The torch.device this rank trains on (the CPU, or its GPU: see runtime/devices.py): build the model there."""
    from unbroken.runtime.devices import rank_device

    cfg = current_config()
    return rank_device(cfg.backend, device=cfg.device)


def __getattr__(name: str):
    if name == "Trainer":  # lazy: importing unbroken must not import torch.distributed eagerly
        from unbroken.runtime.worker import Trainer

        return Trainer
    raise AttributeError(name)
