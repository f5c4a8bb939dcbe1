"""The baseline unbroken is measured against: plain torchrun + DDP + torch.save every K steps.

The same tiny GPT, the same batches, AdamW with the same schedule, but no unbroken: when
a rank dies torchrun (--max-restarts) tears the whole group down, starts 4 new processes,
and every rank resumes from the newest checkpoint. Run by `unbroken bench recovery`:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --nproc-per-node 4 \
        --max-restarts 10 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        -m unbroken.bench.baseline_job --run-dir DIR --checkpoint-every K --kill 1:15 --kill 2:30

DIR/config.json holds the RunConfig. Each kill (rank:step) fires once across restarts (a
marker file records it), by SIGKILL after the step's forward. Events go to DIR/baseline.jsonl.

`unbroken bench overhead` runs it as the native peer of each strategy, failure-free:
`--checkpoint-every 0` saves nothing (not even at the end) and `--optimizer zero` swaps
AdamW for torch's ZeroRedundancyOptimizer over AdamW (the peer of unbroken's zero1);
`--optimizer fsdp2` trains with FSDP2's `fully_shard` (each block, then the root) with
reshard_after_forward=False, ZeRO-2 semantics (the peer of unbroken's zero2), in place of DDP;
`--optimizer fsdp2-reshard` the same with reshard_after_forward=True, ZeRO-3 semantics (the peer
of unbroken's zero3: parameters gathered per block for forward and again for backward).
Every rank logs its peak RSS and live tensor bytes (`unbroken.memory`) when it is done.
Each step record carries compute_s (forward + backward, DDP's overlapped all-reduce
included) and update_s (clipping + optimizer step, ZeRO's parameter broadcast included).
"""
from __future__ import annotations

import time

T_PROCESS = time.time()  # before `import torch`: the restart cost includes the import

import argparse  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from unbroken.config import RunConfig  # noqa: E402
from unbroken.fsutil import atomic_write_bytes  # noqa: E402
from unbroken.memory import live_tensor_bytes, peak_rss_bytes  # noqa: E402
from unbroken.runtime.hard_exit import exit_without_teardown  # noqa: E402
from unbroken.models import VOCAB_SIZE, Corpus, batch_for  # noqa: E402
from unbroken.models.gpt import build_model  # noqa: E402
from unbroken.runtime.devices import bind_rank_device, group_backend  # noqa: E402
from unbroken.jobs.recipe import WarmupCosine as Schedule  # noqa: E402  (lr_at only: the same schedule)

LOG_NAME = "baseline.jsonl"
OPTIMIZERS = ("adamw", "zero", "fsdp2", "fsdp2-reshard")  # AdamW under DDP; ZeroRedundancyOptimizer(AdamW); FSDP2
FSDP = {"fsdp2": False, "fsdp2-reshard": True}  # FSDP2 + AdamW, by its reshard_after_forward


class Log:
    """Appends one JSON line per event (one os.write on O_APPEND: whole lines across processes)."""

    def __init__(self, path: Path, rank: int, restart: int) -> None:
        self.rank, self.restart = rank, restart
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, event: str, t: float | None = None, **fields) -> None:
        rec = {"t": time.time() if t is None else t, "event": event, "rank": self.rank, "restart": self.restart,
               **fields}
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def parse_kill(text: str) -> tuple[int, int]:
    """'1:15' -> (rank 1, step 15)."""
    rank, sep, step = text.partition(":")
    if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
        raise ValueError(f"bad --kill {text!r}; expected RANK:STEP, e.g. 1:15")
    return int(rank), int(step)


def claim_kill(run_dir: Path, rank: int, step: int) -> bool:
    """True exactly once per (rank, step) across restarts: O_EXCL creates the marker."""
    marks = run_dir / "kills"
    marks.mkdir(exist_ok=True)
    try:
        os.close(os.open(marks / f"r{rank}_s{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "ckpt" / f"step_{step:08d}.pt"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (incomplete ones never get their final name)."""
    found = sorted((run_dir / "ckpt").glob("step_*.pt")) if (run_dir / "ckpt").is_dir() else []
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    keep: int = 2) -> int:
    """torch.save to memory, then temp + fsync + rename; returns bytes written."""
    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, buf)
    atomic_write_bytes(checkpoint_path(run_dir, step), buf.getvalue())
    for old in sorted((run_dir / "ckpt").glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return buf.tell()


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["step"])


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW with unbroken's hyperparameters; kind "zero" shards its state (needs a process group)."""
    hyper = {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": cfg.weight_decay}
    if kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    if kind not in ("adamw", *FSDP):
        raise ValueError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")
    return torch.optim.AdamW(model.parameters(), **hyper)


def train(cfg: RunConfig, run_dir: Path, every: int, kills: set[tuple[int, int]],
          optimizer: str = "adamw") -> None:
    """Train to cfg.steps; rank 0 saves a checkpoint every `every` steps and at the end (every=0: never)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(run_dir / LOG_NAME, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    log("process_start", t=T_PROCESS, pid=os.getpid())
    device = bind_rank_device(cfg.backend, cfg.device)  # the CPU, or this rank's GPU
    model = build_model(cfg.model, VOCAB_SIZE, seed=cfg.seed).to(device)
    if optimizer in FSDP:  # shard before the optimizer sees the parameters (they become DTensors)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=FSDP[optimizer])
        fully_shard(model, reshard_after_forward=FSDP[optimizer])
    opt = make_optimizer(model, cfg, optimizer)
    sched = Schedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    ckpt = latest_checkpoint(run_dir)
    start = load_checkpoint(ckpt, model, opt) if ckpt else 0
    # broadcasts rank 0's weights: all ranks agree (FSDP2 sharded them from the same seeded model)
    ddp = model if optimizer in FSDP else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    corpus = Corpus.embedded()
    log("ready", loaded_step=start)
    t_prev = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        x, y = batch_for(corpus, seed=cfg.seed, step=step, rank=rank, world_size=world,
                         batch_size=cfg.batch_size, seq_len=cfg.model.seq_len)
        x, y = x.to(device), y.to(device)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if (rank, step) in kills and claim_kill(run_dir, rank, step):
            log("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        t_grad = time.perf_counter()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        opt.step()
        if step == cfg.steps:  # gradients, parameters and optimizer state all alive
            held = live_tensor_bytes([p.grad for p in model.parameters() if p.grad is not None])
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a step's time is its kernels', not their launch's
        now = time.perf_counter()
        if rank == 0:
            log("step", step=step, loss=round(float(loss.detach()), 6), step_s=round(now - t_prev, 4),
                compute_s=round(t_grad - t_prev, 4), update_s=round(now - t_grad, 4))
        t_prev = now
        if rank == 0 and every > 0 and (step % every == 0 or step == cfg.steps):
            t0 = time.perf_counter()
            nbytes = save_checkpoint(run_dir, step, model, opt)
            log("checkpoint_saved", step=step, save_s=round(time.perf_counter() - t0, 4), bytes=nbytes)
            t_prev = time.perf_counter()  # the next step's time is its own, the save is logged apart
    log("memory", peak_rss_bytes=peak_rss_bytes(), tensor_bytes=held if start < cfg.steps else None)
    if rank == 0 and optimizer not in FSDP:  # FSDP2's parameters are shards: no rank holds them all
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
        log("done", steps=cfg.steps, weights_sha256=digest)
    elif rank == 0:
        log("done", steps=cfg.steps, weights_sha256=None)


def main() -> None:
    ap = argparse.ArgumentParser(description="baseline: torchrun restart-all + torch.save checkpoints")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--checkpoint-every", type=int, required=True, help="steps between saves; 0 = never")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    ap.add_argument("--kill", action="append", default=[], help="RANK:STEP, fired once (repeatable)")
    a = ap.parse_args()
    if a.checkpoint_every < 0:
        raise SystemExit(f"--checkpoint-every must be >= 0 (0 = never), got {a.checkpoint_every}")
    if a.optimizer in ("zero", *FSDP) and a.checkpoint_every:
        raise SystemExit(f"--optimizer {a.optimizer} saves no checkpoints (its state is sharded); "
                         "pass --checkpoint-every 0")
    cfg = RunConfig.from_dict(json.loads((a.run_dir / "config.json").read_text()))
    torch.set_num_threads(cfg.threads)
    dist.init_process_group(group_backend(cfg.backend), timeout=timedelta(seconds=cfg.collective_timeout_s))
    try:
        train(cfg, a.run_dir, a.checkpoint_every, {parse_kill(k) for k in a.kill}, a.optimizer)
        dist.barrier()  # no rank tears gloo down while a peer still has work in flight (it aborts)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every step is logged (each record is one os.write); tearing gloo down here sometimes aborted
    # under ZeroRedundancyOptimizer at 4 ranks, failing a finished run
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
