"""Run configuration: frozen dataclasses validated at construction, loaded from TOML/JSON + CLI.

A user mistake raises `ConfigError` (a ValueError) whose text names the field, the
value given and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STRATEGIES = ("zero1", "zero2", "zero3", "ddp", "fsdp")
SHARDED = ("zero1", "zero2", "zero3", "fsdp")  # each rank owns one shard of the parameters and optimizer state
NONFINITE_POLICIES = ("stop", "skip")
BACKENDS = ("auto", "gloo", "nccl")  # auto: nccl when CUDA is available, else gloo (runtime/devices.py)
DEVICES = ("auto", "cpu", "cuda")  # auto: cuda under nccl, else cpu; gloo + cuda: ranks share GPUs (comm/staged.py)
COLLECTIVES = ("gloo", "static", "adaptive", "chain", "shm")  # the gradient all-reduce: gloo's own, our static
# ring, congestion-aware, the rank-order chain (several ranks per node: node boundaries carry the gradient once
# each way), or shared memory (every rank on one host: no bytes through TCP loopback)
BITWISE_REDUCE = ("auto", "exchange")  # XOR/AND: the backend's BXOR/BAND where it has them, or always exchange
OVERLAP_MODES = ("on", "off", "auto")  # or a plan file FILE.json (unbroken/parallel/overlap.py)


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Tiny char-level GPT. The defaults give ~3.2M parameters."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    seq_len: int = 64

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "seq_len"):
            v = getattr(self, name)
            _need(isinstance(v, int) and v >= 1, f"model.{name} must be an integer >= 1, got {v!r}")
        _need(self.n_embd % self.n_head == 0,
              f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs; identical in every process of the job."""

    world_size: int = 4
    steps: int = 60
    # True when steps came from --steps or the config file: a script's trainer.steps(n) must then
    # agree; False: the script's trainer.steps(n) decides (and the summary records what ran)
    steps_given: bool = False
    seed: int = 0
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    strategy: str = "zero1"
    parity_group: int = 4
    tier1: bool = True
    # Tier-1 parity is brought up to date every `protect_every` steps (1 = every step);
    # in between, survivors replay a lost shard from the parity point with the logged
    # averaged gradients. "auto" picks K from measured step and parity times.
    protect_every: int | str = 8
    expected_mtbf_s: float = 10800.0  # for protect_every "auto": expected time between failures of the job
    chunk_kb: int = 1024  # transaction/parity chunk (3 tensors): fewer, larger chunks cost less per-op dispatch
    bucket_kb: int = 25600  # gradient all-reduce bucket, issued while backward runs (as torch DDP: 25 MB)
    # on: buckets all-reduced while backward runs; off: after backward; auto: tuned at the first
    # step (cached); FILE.json: a plan file (its own bucket size and core partition)
    overlap: str = "on"
    checkpoint_every: int = 50  # tier 2 (two losses in a parity group, a corrupted parity); 0 = off
    checkpoint_keep: int = 2
    shadows: int | str = 1  # pre-started shadows per node, or "auto" (sized from the failure rate)
    max_shadows: int = 4  # the most "auto" keeps per node
    # Retries: at most `retry_budget` generations for one incident (until a step completes),
    # and at most `max_recoveries_per_hour` recoveries in any hour of the job (0 = no limit).
    retry_budget: int = 8
    max_recoveries_per_hour: int = 60
    # A step whose averaged gradient stays non-finite after `nonfinite_retries` redos:
    # "stop" the job naming the step and tensor, or "skip" the step (no update applied).
    on_nonfinite: str = "stop"
    nonfinite_retries: int = 2
    node_lease_s: float = 3.0  # a node whose supervisor has not renewed its lease for this long is lost
    heartbeat_s: float = 0.1
    hang_timeout_s: float = 5.0
    collective_timeout_s: float = 60.0
    straggler_window_steps: int = 10
    exclude_after_faults: int = 3
    exclude_window_s: float = 3600.0
    threads: int = 1
    backend: str = "auto"  # the data collectives' backend; control traffic stays on the store and gloo
    device: str = "auto"  # where ranks train: auto (the backend's), cpu, or cuda (under gloo: GPUs shared, host-staged)
    bitwise_reduce: str = "auto"  # "exchange": XOR/AND by all-to-all/gather + local op even where gloo has BXOR
    collectives: str = "gloo"  # ddp/zero1 gradient all-reduce: gloo's, our static ring or adaptive (comm/adaptive.py)
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        self._check_job()
        self._check_recovery()
        self._check_runtime()
        if isinstance(self.model, dict):  # from JSON/TOML
            object.__setattr__(self, "model", ModelConfig(**_known(ModelConfig, self.model, "model.")))

    def _check_job(self) -> None:
        _need(isinstance(self.world_size, int) and self.world_size >= 1,
              f"world_size must be an integer >= 1, got {self.world_size!r}; e.g. --world-size 4")
        _need(isinstance(self.steps, int) and self.steps >= 1,
              f"steps must be an integer >= 1, got {self.steps!r}; e.g. --steps 60")
        _need(isinstance(self.batch_size, int) and self.batch_size >= 1,
              f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        _need(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        _need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        _need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip!r}")
        _need(self.strategy in STRATEGIES,
              f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        _need(isinstance(self.parity_group, int) and self.parity_group >= 2,
              f"parity_group must be an integer >= 2, got {self.parity_group!r}")
        k = min(self.parity_group, self.world_size)
        _need(self.world_size == 1 or self.world_size % k == 0,
              f"parity_group ({self.parity_group}) must divide world_size ({self.world_size}); "
              f"choose a divisor such as {self.world_size if self.world_size <= 4 else 4}")
        _need(self.protect_every == "auto" or (isinstance(self.protect_every, int)
                                               and not isinstance(self.protect_every, bool) and self.protect_every >= 1),
              f"protect_every must be an integer >= 1 or 'auto', got {self.protect_every!r}; "
              "e.g. --protect-every 8 (1 = parity every step)")
        _need(isinstance(self.expected_mtbf_s, (int, float)) and self.expected_mtbf_s > 0,
              f"expected_mtbf_s must be > 0 seconds, got {self.expected_mtbf_s!r}")
        _need(self.chunk_kb >= 1, f"chunk_kb must be >= 1, got {self.chunk_kb!r}")
        _need(isinstance(self.bucket_kb, int) and self.bucket_kb >= 1,
              f"bucket_kb must be an integer >= 1, got {self.bucket_kb!r}; e.g. bucket_kb = 1024")
        _need((err := check_overlap_mode(self.overlap)) is None, err or "")
        _need(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0 (0 = off), got {self.checkpoint_every!r}")
        _need(self.checkpoint_keep >= 1, f"checkpoint_keep must be >= 1, got {self.checkpoint_keep!r}")

    def _check_recovery(self) -> None:
        _need(self.shadows == "auto" or (isinstance(self.shadows, int) and not isinstance(self.shadows, bool)
                                         and self.shadows >= 0),
              f"shadows must be an integer >= 0 or 'auto', got {self.shadows!r}; e.g. --shadows 1")
        _need(isinstance(self.max_shadows, int) and self.max_shadows >= 1,
              f"max_shadows must be an integer >= 1, got {self.max_shadows!r}")
        _need(isinstance(self.retry_budget, int) and self.retry_budget >= 1,
              f"retry_budget must be an integer >= 1 (attempts per incident), got {self.retry_budget!r}; "
              "e.g. --retry-budget 8")
        _need(isinstance(self.max_recoveries_per_hour, int) and self.max_recoveries_per_hour >= 0,
              f"max_recoveries_per_hour must be an integer >= 0 (0 = no limit), got {self.max_recoveries_per_hour!r}")
        _need(self.on_nonfinite in NONFINITE_POLICIES,
              f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.on_nonfinite!r}; "
              "e.g. --on-nonfinite skip")
        _need(isinstance(self.nonfinite_retries, int) and self.nonfinite_retries >= 0,
              f"nonfinite_retries must be an integer >= 0, got {self.nonfinite_retries!r}")
        _need(self.node_lease_s >= 5 * self.heartbeat_s,
              f"node_lease_s ({self.node_lease_s}) must be at least 5 heartbeats ({5 * self.heartbeat_s})")
        _need(self.heartbeat_s > 0, f"heartbeat_s must be > 0, got {self.heartbeat_s!r}")
        _need(self.hang_timeout_s >= 3 * self.heartbeat_s,
              f"hang_timeout_s ({self.hang_timeout_s}) must be at least 3 heartbeats ({3 * self.heartbeat_s})")
        _need(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        _need(self.straggler_window_steps >= 1,
              f"straggler_window_steps must be >= 1, got {self.straggler_window_steps!r}")
        _need(self.exclude_after_faults >= 1, f"exclude_after_faults must be >= 1, got {self.exclude_after_faults!r}")
        _need(self.exclude_window_s > 0, f"exclude_window_s must be > 0, got {self.exclude_window_s!r}")

    def _check_runtime(self) -> None:
        _need(self.threads >= 1, f"threads must be >= 1, got {self.threads!r}")
        _need(self.backend in BACKENDS,
              f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}; e.g. --backend gloo")
        _need(self.device in DEVICES,
              f"device must be one of {', '.join(DEVICES)}, got {self.device!r}; e.g. --device cuda")
        _need(not (self.backend == "nccl" and self.device == "cpu"),
              "backend nccl moves CUDA tensors, but device is cpu; use --device cuda (or auto) or --backend gloo")
        _need(self.bitwise_reduce in BITWISE_REDUCE,
              f"bitwise_reduce must be one of {', '.join(BITWISE_REDUCE)}, got {self.bitwise_reduce!r}")
        _need(self.collectives in COLLECTIVES,
              f"collectives must be one of {', '.join(COLLECTIVES)}, got {self.collectives!r}; e.g. --collectives adaptive")
        _need(self.collectives == "gloo" or (self.backend != "nccl" and self.device != "cuda"),
              f"collectives {self.collectives!r} runs on gloo with CPU tensors, but the job trains on CUDA "
              f"(backend {self.backend}, device {self.device}); use --collectives gloo, or --backend gloo --device cpu")

    @property
    def shadow_pool_max(self) -> int:
        """The most shadows a node may keep (the memory budget counts them)."""
        return self.max_shadows if self.shadows == "auto" else self.shadows

    @property
    def effective_parity_group(self) -> int:
        return min(self.parity_group, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RunConfig":
        return RunConfig(**_known(RunConfig, d, ""))


def check_overlap_mode(value: object) -> str | None:
    """None if `value` is a valid --overlap value, else the one-line error."""
    if isinstance(value, str) and value in OVERLAP_MODES:
        return None
    if not isinstance(value, str) or not value.endswith(".json"):
        return (f"overlap must be one of {', '.join(OVERLAP_MODES)} or a plan file FILE.json, got {value!r}; "
                "e.g. --overlap auto")
    p = Path(value)
    if p.is_dir():
        return f"overlap plan file {value} is a directory; name a .json file"
    if not p.parent.is_dir():
        return f"overlap plan file {value}: directory {p.parent} does not exist; create it or use another path"
    return None


def _known(cls: type, d: dict[str, Any], prefix: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!r}; allowed keys: {', '.join(sorted(names))}")
    return dict(d)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON) config file into a dict; errors name the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}; check the path") from None
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None


def build_config(file: str | Path | None = None, **overrides: Any) -> RunConfig:
    """File values first, then CLI overrides (those not None) win."""
    base = load_config_file(file) if file else {}
    model = dict(base.pop("model", {}) or {})
    for k in list(overrides):
        if k.startswith("model_") and overrides[k] is not None:
            model[k[len("model_"):]] = overrides.pop(k)
        elif k.startswith("model_"):
            overrides.pop(k)
    base.update({k: v for k, v in overrides.items() if v is not None})
    base.setdefault("steps_given", "steps" in base)
    base["model"] = ModelConfig(**_known(ModelConfig, model, "model."))
    return RunConfig.from_dict(base)
