"""The warm-started policy of a config, cached on disk: pre-training takes seconds, and every method
of a benchmark (and a rerun) must start from the same weights. The cache key is the config's
pre-training fields; the file is written atomically and its checksum is in its name."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from unbroken.fsutil import atomic_write_bytes
from unbroken.rl import policy
from unbroken.rl.config import RLConfig

KEY_FIELDS = ("digits", "lengths", "max_repeat", "n_layer", "n_head", "n_embd", "pretrain_steps", "pretrain_batch",
              "pretrain_lr", "pretrain_noise", "seed")


def warm_state(cfg: RLConfig, cache_dir: Path | None) -> bytes:
    """The pre-trained state_dict as torch.save bytes, from `cache_dir` when there (and intact)."""
    key = hashlib.sha256(json.dumps({k: getattr(cfg, k) for k in KEY_FIELDS}, sort_keys=True).encode()).hexdigest()
    if cache_dir is not None:
        for f in Path(cache_dir).glob(f"warm-{key[:16]}-*.pt"):
            data = f.read_bytes()
            if hashlib.sha256(data).hexdigest()[:16] == f.stem.rsplit("-", 1)[1]:
                return data
    data = policy.state_bytes(policy.pretrain(cfg))
    if cache_dir is not None:
        atomic_write_bytes(Path(cache_dir) / f"warm-{key[:16]}-{hashlib.sha256(data).hexdigest()[:16]}.pt", data)
    return data
