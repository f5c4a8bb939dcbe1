"""LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors):
writing synthetic ones, reading and checking one against the served base model."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from unbroken.config import ModelConfig
from unbroken.fsutil import atomic_write_bytes, atomic_write_json
from unbroken.serve.config import base_model_id, lora_targets

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


class RequestError(ValueError):
    """A request cannot be served here; the message says why and what to do (an HTTP 4xx status)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: per target module, A (r x in) and B (out x r) in fp32, and alpha / r."""

    name: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def valid_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name))


def write_adapter(root: Path, name: str, *, model: ModelConfig, rank: int, seed: int, alpha: float | None = None,
                  base: str | None = None, std: float = 0.02) -> Path:
    """A synthetic adapter (random A and B, fixed by `seed`) saved the way PEFT's save_pretrained does."""
    assert valid_name(name), name
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for mod, (i, o) in lora_targets(model).items():
        tensors[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(rank, i, generator=gen) * std
        tensors[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * std
    cfg = {"peft_type": "LORA", "task_type": None, "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "target_modules": ["qkv", "proj"], "base_model_name_or_path": base or base_model_id(model),
           "inference_mode": True}
    d = Path(root) / name
    atomic_write_bytes(d / "adapter_model.safetensors", save(tensors))
    atomic_write_json(d / "adapter_config.json", cfg)
    return d


def read_adapter(root: Path, name: str, *, model: ModelConfig, base: str, max_rank: int) -> Adapter:
    """Load adapter `name` from `root`, or raise RequestError (unknown 404, wrong base/rank/shape 400)."""
    if not valid_name(name):
        raise RequestError(f"adapter name {name!r} is not valid: use letters, digits, '_', '.', '-'")
    d = Path(root) / name
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise RequestError(f"unknown adapter {name!r}: no {cfg_path.name} under {root}; "
                           "list the served ones at GET /v1/models", 404)
    try:
        cfg = json.loads(cfg_path.read_text())
        tensors = load_file(str(d / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise RequestError(f"adapter {name!r} is unreadable ({e}); rewrite it with PEFT's save_pretrained") from e
    if cfg.get("peft_type") != "LORA":
        raise RequestError(f"adapter {name!r} is {cfg.get('peft_type')!r}, not LORA: only LoRA adapters are served")
    if cfg.get("base_model_name_or_path") != base:
        raise RequestError(f"adapter {name!r} was trained for base {cfg.get('base_model_name_or_path')!r}, "
                           f"this server serves {base!r}: send it to a server of that base")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise RequestError(f"adapter {name!r} has rank {rank!r}, beyond this server's limit 1..{max_rank}: "
                           "serve it on a server started with a larger --max-rank")
    return Adapter(name, rank, float(cfg.get("lora_alpha", rank)) / rank, _weights(name, tensors, model, rank))


def _weights(name: str, tensors: dict, model: ModelConfig, rank: int) -> dict:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m:
            parts.setdefault(m.group(1).removesuffix(".default"), {})[m.group(2)] = t.float()
    out = {}
    for mod, (i, o) in lora_targets(model).items():
        ab = parts.get(mod, {})
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or tuple(a.shape) != (rank, i) or tuple(b.shape) != (o, rank):
            raise RequestError(f"adapter {name!r} has no LoRA weights of shape ({rank}, {i})/({o}, {rank}) for "
                               f"{mod}: it does not fit this base model")
        out[mod] = (a.contiguous(), b.contiguous())
    return out
