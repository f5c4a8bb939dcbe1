"""unbroken: keep PyTorch training productive while hardware fails.

Public API: `unbroken.Trainer` (inside a script launched by `unbroken run`),
`unbroken.RunConfig`, and the `unbroken` CLI.
"""
from unbroken.config import ModelConfig, RunConfig

__all__ = ["ModelConfig", "RunConfig"]
__version__ = "0.1.0"
