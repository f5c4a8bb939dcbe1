"""`unbroken predict profile`: measure power and ITL of a model served here, in the measurement schema.

By default the model is the built-in TinyGPT decoding `--tokens` tokens for `--batch` sequences
(greedy, full recompute over a sliding window: no KV cache, so this is a worst case for ITL).
`--like NAME` times a random-weight replica of a model in the tables instead, with
transformers' `generate` and its KV cache (`replica.py`), so the row is one the predictor
knows: batch 1 is ML.ENERGY 2023's "single" scenario. Power
comes from NVML (nvidia-smi, polled in a thread) on a GPU, from RAPL powercap energy counters
on a CPU where readable, else it is recorded as missing. The output folder gets
`measurements.jsonl` (one line per run, appended) and `model_specs.csv` (the model's row, for
--model-specs), so `unbroken predict --check DIR/measurements.jsonl --model-specs ...` can
compare the predictions with what was measured.
"""
from __future__ import annotations

import math
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from unbroken.cli_error import fail
from unbroken.fsutil import atomic_write_bytes
from unbroken.predict.measurements import Measurement, to_json_line

RAPL = Path("/sys/class/powercap")
POLL_S = 0.1


def rapl_energy_uj() -> Optional[int]:
    """Sum of the package energy counters (µJ), or None where powercap is absent or unreadable."""
    total, found = 0, False
    for zone in sorted(RAPL.glob("intel-rapl:[0-9]*")):
        if ":" in zone.name.split("intel-rapl:")[1]:
            continue  # subzones (core, dram) are inside the package counter
        try:
            total += int((zone / "energy_uj").read_text())
            found = True
        except (OSError, ValueError):
            return None
    return total if found else None


class NvmlPoller:
    """Polls `nvidia-smi --query-gpu=power.draw` for GPU `index` in a thread; mean() of the samples."""

    def __init__(self, index: int) -> None:
        self.index, self.samples, self._stop = index, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> Optional[float]:
        try:
            p = subprocess.run(["nvidia-smi", f"--id={self.index}", "--query-gpu=power.draw",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            return float(p.stdout.strip().splitlines()[0]) if p.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self._read()
            if v is not None:
                self.samples.append(v)
            self._stop.wait(POLL_S)

    def __enter__(self) -> "NvmlPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.nan


def decode(model, batch: int, tokens: int, vocab: int, device, seed: int = 0) -> float:
    """Greedy decoding of `tokens` tokens for `batch` sequences; returns seconds per decode step."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (batch, model.cfg.seq_len // 2), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        model(seq[:, -model.cfg.seq_len:])  # warm-up: kernels, allocator
        sync()
        t0 = time.perf_counter()
        for _ in range(tokens):
            nxt = model(seq[:, -model.cfg.seq_len:])[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        sync()
    return (time.perf_counter() - t0) / tokens


def model_spec_row(name: str, model) -> str:
    c = model.cfg
    params = sum(p.numel() for p in model.parameters()) / 1e9
    return (f"{name};{params:.6g};{params:.6g};{c.n_layer};{c.n_embd};{c.n_head};{c.n_head};"
            f"unbroken TinyGPT config (measured here)\n")


def _append(path: Path, line: str) -> None:
    old = path.read_text() if path.exists() else ""
    atomic_write_bytes(path, (old + line + "\n").encode())


def _measure_power(device: str, gpu_index: int, work) -> tuple[float, float]:
    """(result of work(), mean power in W or NaN): NVML on a GPU, RAPL on a CPU where readable."""
    if device == "cuda":
        with NvmlPoller(gpu_index) as poll:
            result = work()
        return result, poll.mean()
    e0, t0 = rapl_energy_uj(), time.monotonic()
    result = work()
    e1, t1 = rapl_energy_uj(), time.monotonic()
    power = (e1 - e0) / 1e6 / (t1 - t0) if e0 is not None and e1 is not None and e1 >= e0 else math.nan
    return result, power


def _tiny_gpt(layers: int, width: int, batch: int, tokens: int, dev):
    """(model, name, prompt tokens, work) for unbroken's TinyGPT decoding without a KV cache."""
    from unbroken.config import ModelConfig
    from unbroken.models.gpt import build_model

    try:
        cfg = ModelConfig(n_layer=layers, n_head=max(1, width // 64), n_embd=width, seq_len=256)
    except ValueError as e:
        fail(str(e))
    model = build_model(cfg, 256, seed=0).to(dev).eval()
    return model, f"unbroken/tiny-gpt-l{layers}-d{width}", cfg.seq_len // 2, lambda: decode(model, batch, tokens, 256, dev)


def _like(name: str, batch: int, prompt: int, tokens: int, dev, dtype: str):
    """(None, table name, prompt tokens, work) for a random-weight replica of table model `name`."""
    import torch

    from unbroken.predict import replica
    from unbroken.predict.tables import SpecError, load_models

    try:
        spec = load_models().get(name)
        model = replica.build(spec, dev, getattr(torch, dtype))
    except SpecError as e:
        fail(str(e))
    typer.echo(f"{spec.name}: random-weight replica, {replica.parameter_count(model):.2f}B parameters "
               f"(table: {spec.total_b_params:g}B), {dtype}")
    return None, spec.name, prompt, lambda: replica.time_generate(model, batch, prompt, tokens, dev)


def profile(gpu: str = typer.Option(..., "--gpu", help="the GPU's (or CPU's) name in the spec tables"),
            out: Path = typer.Option(Path("predict-profile"), "--out", help="folder for measurements.jsonl"),
            batch: int = typer.Option(8, "--batch", help="sequences decoded together"),
            tokens: int = typer.Option(64, "--tokens", help="decode steps to time"),
            layers: int = typer.Option(4, "--layers", help="TinyGPT layers"),
            width: int = typer.Option(256, "--width", help="TinyGPT hidden size"),
            like: Optional[str] = typer.Option(None, "--like", help="a model in the tables: time a random-weight "
                                               "replica of it with transformers' generate instead of TinyGPT"),
            prompt: int = typer.Option(64, "--prompt-tokens", help="prompt length (with --like)"),
            dtype: str = typer.Option("float16", "--dtype", help="float16, bfloat16 or float32 (with --like)"),
            device: str = typer.Option("auto", "--device", help="cuda, cpu or auto"),
            gpu_index: int = typer.Option(0, "--gpu-index", help="which GPU NVML reads")) -> None:
    """Measure ITL and power of a decode here; append them to OUT/measurements.jsonl."""
    import torch

    if batch < 1 or tokens < 1 or prompt < 1:
        fail(f"--batch, --tokens and --prompt-tokens must be >= 1, got {batch}, {tokens} and {prompt}")
    if dtype not in ("float16", "bfloat16", "float32"):
        fail(f"--dtype {dtype!r}: use float16, bfloat16 or float32")
    if device not in ("auto", "cuda", "cpu"):
        fail(f"--device {device!r}: use cuda, cpu or auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here; use --device cpu")
    dev = torch.device(device)
    model, name, prompt_used, work = (_like(like, batch, prompt, tokens, dev, dtype) if like
                                      else _tiny_gpt(layers, width, batch, tokens, dev))
    itl, power = _measure_power(device, gpu_index, work)
    scenario = "single" if like and batch == 1 else "offline"
    m = Measurement(dataset="profile", gpu=gpu, model=name, n_gpus=1, batch=float(batch),
                    prompt_tokens=float(prompt_used), output_tokens=float(tokens), scenario=scenario,
                    framework="transformers", power_w=power, itl_s=itl, source=f"unbroken predict profile ({device})")
    out.mkdir(parents=True, exist_ok=True)
    _append(out / "measurements.jsonl", to_json_line(m))
    if model is not None:
        _write_spec(out / "model_specs.csv", name, model)
    typer.echo(f"{name} on {gpu} ({device}): ITL {itl * 1e3:.3f} ms, power "
               f"{'not readable here' if math.isnan(power) else f'{power:.1f} W'}; appended to {out / 'measurements.jsonl'}")


def _write_spec(specs: Path, name: str, model) -> None:
    """The TinyGPT's row, for --model-specs (a --like model is in the tables already)."""
    if not specs.exists():
        atomic_write_bytes(specs, ("model_name;total_b_params;active_b_params;num_layers;hidden_size;"
                                   "num_attention_heads;num_key_value_heads;source\n").encode())
    if name not in specs.read_text():
        _append(specs, model_spec_row(name, model).rstrip("\n"))
