"""The compute term, measured once per model: forward, backward and AdamW step times, per-unit shares.

A model is the built-in tiny GPT at a `ModelConfig` (`parse_model("n_layer=2,n_embd=128")`).
Its sharding units are its blocks plus the root (embeddings, final norm, the tied head), as
`plan/native_job.py` wraps them with `fully_shard`. `measure()` runs `ranks_per_host`
processes at once (ranks that share a host share its cores: the times must include that),
each timing --steps forward/backward/step rounds, and keeps the median over ranks and
rounds; then, per strategy, `ranks_per_host` world-1 copies of its native job: a step with
the framework's own work (DDP's buckets, FSDP2's copies) and no communication, taken as the
slowest copy's per step (a synchronous step waits for the slowest rank). Per-unit compute shares come from torch's FlopCounterMode; activation bytes from
the tensors autograd saves for backward. Cached as JSON (`unbroken-profile/1`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError, ModelConfig
from unbroken.fsutil import atomic_write_json

FORMAT = "unbroken-profile/1"
PRESETS = {"tiny-gpt": {}, "small": {"n_layer": 2, "n_embd": 128}}


def parse_model(spec: str) -> ModelConfig:
    """A preset name (tiny-gpt, small) or key=value pairs over ModelConfig's defaults."""
    spec = spec.strip()
    if spec in PRESETS:
        return ModelConfig(**PRESETS[spec])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, int] = {}
    for part in filter(None, spec.split(",")):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ConfigError(f"--model {spec!r}: {part!r} is not a preset ({', '.join(PRESETS)}) or "
                              f"key=value over {', '.join(sorted(fields))}")
        try:
            kw[key] = int(value)
        except ValueError:
            raise ConfigError(f"--model {spec!r}: {key}={value!r} must be an integer") from None
    return ModelConfig(**kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    name: str
    params: int         # elements
    flop_share: float   # of the model's forward FLOPs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelProfile:
    model: dict[str, int]
    batch_size: int
    ranks_per_host: int
    threads: int
    params: int
    units: tuple[Unit, ...]
    forward_s: float
    backward_s: float
    optimizer_s: float      # AdamW over every parameter
    activation_bytes: int   # saved for backward, one micro-batch
    tensor_elems: tuple[int, ...]  # each parameter tensor's elements, registration order
    solo_step_s: dict[str, float]  # per strategy: a world-1 step (its framework's own work), slowest of the copies

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["units"] = [dataclasses.asdict(u) for u in self.units]
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConfigError(f"not a {FORMAT} profile; measure it again with `unbroken plan --model ...`")
        d = {k: v for k, v in d.items() if k != "format"}
        d["units"] = tuple(Unit(**u) for u in d["units"])
        d["tensor_elems"] = tuple(d["tensor_elems"])
        return cls(**d)

    def matches(self, model: ModelConfig, batch_size: int, ranks_per_host: int, threads: int) -> bool:
        return (self.model == dataclasses.asdict(model) and self.batch_size == batch_size
                and self.ranks_per_host == ranks_per_host and self.threads == threads)


def _units(model) -> list[Unit]:
    """Blocks, then the root; FLOP shares from one forward under FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.zeros(1, model.cfg.seq_len, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x)
    per_module = counter.get_flop_counts()
    total = max(1, sum(per_module.get("Global", {}).values()))
    units, in_blocks = [], 0
    for i, block in enumerate(model.blocks):
        flops = sum(per_module.get(f"TinyGPT.blocks.{i}", {}).values())
        n = sum(p.numel() for p in block.parameters())
        units.append(Unit(name=f"blocks.{i}", params=n, flop_share=flops / total))
        in_blocks += n
    rest = sum(p.numel() for p in model.parameters()) - in_blocks
    units.append(Unit(name="root", params=rest, flop_share=max(0.0, 1.0 - sum(u.flop_share for u in units))))
    return units


def _time_rounds(model_cfg: ModelConfig, batch_size: int, steps: int) -> dict[str, Any]:
    import torch

    from unbroken.models.data import VOCAB_SIZE, Corpus, batch_for
    from unbroken.models.gpt import build_model

    corpus = Corpus.embedded()
    model = build_model(model_cfg, VOCAB_SIZE, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd, bwd, step, saved = [], [], [], {}

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:  # views of one storage count once; parameters are state
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    for s in range(steps + 2):
        x, y = batch_for(corpus, seed=0, step=s, rank=0, world_size=1, batch_size=batch_size, seq_len=model_cfg.seq_len)
        saved.clear()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        if s >= 2:  # the first rounds allocate
            fwd.append(t1 - t0), bwd.append(t2 - t1), step.append(t3 - t2)
    return {"forward_s": fwd, "backward_s": bwd, "optimizer_s": step, "activation_bytes": sum(saved.values()),
            "units": [dataclasses.asdict(u) for u in _units(model)],
            "tensor_elems": [p.numel() for p in model.parameters()],
            "params": sum(p.numel() for p in model.parameters())}


def measure(model_cfg: ModelConfig, *, batch_size: int, ranks_per_host: int, threads: int = 1,
            steps: int = 8, timeout_s: float = 300.0, repeats: int = 3) -> ModelProfile:
    """Time the model on `ranks_per_host` concurrent processes (no communication between them).
    The per-strategy solo steps are measured `repeats` times, interleaved over the strategies,
    and their median kept: one run of each swung by 10-25 % from one run to the next on a shared
    2-core machine, and the planner's step time is that solo step plus the exposed collectives."""
    import tempfile

    from unbroken.plan import native_job
    from unbroken.plan.ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spec = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(model_cfg).items())

        def argv(r: int, _master: str) -> list[str]:
            return [sys.executable, "-m", "unbroken.plan.profile", "--model", spec, "--batch-size", str(batch_size),
                    "--steps", str(steps), "--out", str(Path(tmp) / f"{r}.json")]

        run_ranks(argv, ranks_per_host, env={"OMP_NUM_THREADS": str(threads)}, timeout_s=timeout_s,
                  what="model profile")
        rounds = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(ranks_per_host)]
        runs: dict[str, list[float]] = {s: [] for s in native_job.STRATEGIES}
        for _ in range(max(1, repeats)):
            for s in native_job.STRATEGIES:
                runs[s].append(native_job.run_solo(s, ranks_per_host, tmp, model=model_cfg, batch_size=batch_size,
                                                   timeout_s=timeout_s))
        solo = {s: statistics.median(v) for s, v in runs.items()}
    med = {k: statistics.median(x for r in rounds for x in r[k]) for k in ("forward_s", "backward_s", "optimizer_s")}
    first = rounds[0]
    return ModelProfile(model=dataclasses.asdict(model_cfg), batch_size=batch_size, ranks_per_host=ranks_per_host,
                        threads=threads, params=first["params"], units=tuple(Unit(**u) for u in first["units"]),
                        activation_bytes=first["activation_bytes"], tensor_elems=tuple(first["tensor_elems"]),
                        solo_step_s=solo, **med)


def load_or_measure(path: Path | None, model_cfg: ModelConfig, *, batch_size: int, ranks_per_host: int,
                    threads: int = 1) -> ModelProfile:
    """The cached profile at `path` if it is this model's; else measure it (and cache it there)."""
    if path is not None and Path(path).exists():
        try:
            prof = ModelProfile.from_dict(json.loads(Path(path).read_text()))
            if prof.matches(model_cfg, batch_size, ranks_per_host, threads):
                return prof
        except (ValueError, TypeError, KeyError):
            pass  # another format or model: measure again
    prof = measure(model_cfg, batch_size=batch_size, ranks_per_host=ranks_per_host, threads=threads)
    if path is not None:
        atomic_write_json(Path(path), prof.to_dict())
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one process of a model profile (see plan/profile.py)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    atomic_write_json(a.out, _time_rounds(parse_model(a.model), a.batch_size, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
