"""ServeConfig: one server's model, batching, adapter-cache and memory limits (validated at construction)."""
from __future__ import annotations

from dataclasses import dataclass

from unbroken.config import ConfigError, ModelConfig

BASE_SEED = 0


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def serve_model() -> ModelConfig:
    """The served base model: the repo's tiny GPT (ModelConfig's defaults, ~3.2M parameters)."""
    return ModelConfig()


def base_model_id(model: ModelConfig, seed: int = BASE_SEED) -> str:
    """What adapters name as their base (PEFT's `base_model_name_or_path`)."""
    return f"unbroken/tiny-gpt-L{model.n_layer}-H{model.n_head}-E{model.n_embd}-T{model.seq_len}-seed{seed}"


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """max_batch: requests decoded together; slots: adapters resident at once (the LRU cache);
    max_rank: the largest LoRA rank a slot holds; max_waiting: queued requests before 429;
    memory_mb: the server's budget for weights + adapter slots + activations."""

    max_batch: int = 8
    slots: int = 4
    max_rank: int = 16
    max_waiting: int = 256
    memory_mb: float = 64.0
    starve_s: float = 2.0  # a request queued longer than this before its first token starved
    seed: int = BASE_SEED

    def __post_init__(self) -> None:
        for name in ("max_batch", "slots", "max_rank", "max_waiting"):
            v = getattr(self, name)
            _need(isinstance(v, int) and v >= 1, f"{name} must be an integer >= 1, got {v!r}")
        _need(self.memory_mb > 0, f"memory_mb must be > 0, got {self.memory_mb!r}")
        _need(self.starve_s > 0, f"starve_s must be > 0, got {self.starve_s!r}")
        need = memory_bytes(serve_model(), self.max_batch, self.slots, self.max_rank) / 2**20
        _need(need <= self.memory_mb, f"{self.slots} adapter slots of rank {self.max_rank} with batch "
              f"{self.max_batch} need {need:.1f} MB, over memory_mb {self.memory_mb}: lower slots/max_rank/"
              f"max_batch or raise memory_mb")


def lora_targets(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """The adapted linears (PEFT target_modules qkv and proj): module name -> (in, out)."""
    c = model.n_embd
    out = {}
    for i in range(model.n_layer):
        out[f"blocks.{i}.qkv"] = (c, 3 * c)
        out[f"blocks.{i}.proj"] = (c, c)
    return out


def adapter_bytes(model: ModelConfig, rank: int) -> int:
    """fp32 bytes of one adapter of `rank` (A: r x in, B: out x r per target)."""
    return 4 * rank * sum(i + o for i, o in lora_targets(model).values())


def memory_bytes(model: ModelConfig, max_batch: int, slots: int, max_rank: int) -> int:
    """Weights + the adapter slots (sized for max_rank) + one iteration's activations (a bound)."""
    from unbroken.models.data import VOCAB_SIZE

    c, t, L = model.n_embd, model.seq_len, model.n_layer
    weights = 4 * (VOCAB_SIZE * c + t * c + L * (12 * c * c + 13 * c) + 2 * c)
    acts = 4 * max_batch * t * (12 * c + VOCAB_SIZE + model.n_head * t)
    return weights + (slots + 1) * adapter_bytes(model, max_rank) + acts
