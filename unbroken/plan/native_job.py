"""One rank of a strategy as PyTorch implements it: the planner's ground truth and its compute profile.

    python -m unbroken.plan.native_job --strategy S --rank R --world N --master HOST:PORT \
        --out FILE [--steps 12] [--n-layer 2 --n-embd 128 --seq-len 64 --batch-size 8]

    ddp    torch DDP (25 MB buckets, all-reduce overlapped with backward) + AdamW
    zero1  torch DDP + ZeroRedundancyOptimizer(AdamW) (optimizer state sharded, parameters broadcast)
    zero2  FSDP2 fully_shard per block + root, reshard_after_forward=False (gradients reduce-scattered)
    zero3  FSDP2 fully_shard per block + root, reshard_after_forward=True (parameters gathered per layer)

The tiny GPT, its batches and AdamW are the built-in job's. Each rank times every step
(wall, between barriers) and counts its state's tensor bytes (parameters, gradients,
optimizer state: its own shards for the sharded strategies), the peak tensor bytes of one
more (untimed, profiled) step, its peak RSS and, inside a namespace, the bytes its link
sent per step. Rank 0 writes all ranks' figures to --out.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.config import ModelConfig
from unbroken.fsutil import atomic_write_json
from unbroken.runtime.hard_exit import exit_without_teardown
from unbroken.models.data import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
IMPLEMENTATION = {"ddp": "torch DDP + AdamW", "zero1": "torch DDP + ZeroRedundancyOptimizer(AdamW)",
                  "zero2": "FSDP2 fully_shard(reshard_after_forward=False) + AdamW",
                  "zero3": "FSDP2 fully_shard(reshard_after_forward=True) + AdamW"}
WARMUP = 2


def wrap(model: torch.nn.Module, strategy: str, lr: float):
    """(the model to call, its optimizer) for `strategy`."""
    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if strategy == "ddp":
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = strategy == "zero3"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def local_bytes(t: torch.Tensor) -> int:
    """This rank's bytes of t (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    optim = sum(local_bytes(v) for s in inner.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def step_peak_bytes(run_step, before: int) -> int:
    """Peak tensor bytes during one run_step(): the live state before it plus the highest the
    step's own allocations minus frees climb (torch's profiler records every CPU allocation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = top = 0
    for _, d in deltas:
        level += d
        top = max(top, level)
    return before + top


def tx_bytes() -> int | None:
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return None


def train(a: argparse.Namespace) -> dict:
    cfg = ModelConfig(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, seq_len=a.seq_len)
    corpus = Corpus.embedded()
    model = build_model(cfg, VOCAB_SIZE, seed=0)
    net, opt = wrap(model, a.strategy, lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    times, sent, losses = [], [], []

    def one_step(step: int) -> None:
        x, y = batch_for(corpus, seed=0, step=step, rank=rank, world_size=world, batch_size=a.batch_size,
                         seq_len=cfg.seq_len)
        loss = model.loss(x, y) if net is model else _ddp_loss(net, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(float(loss))

    for step in range(1, a.steps + 1):
        dist.barrier()
        tx0, t0 = tx_bytes(), time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t0)
        tx1 = tx_bytes()
        if tx0 is not None and tx1 is not None:
            sent.append(tx1 - tx0)
    dist.barrier()
    peak = step_peak_bytes(lambda: one_step(a.steps + 1), state_bytes(model, opt)["total"])  # not timed
    keep = times[WARMUP:]
    return {"step_s": keep, "median_step_s": statistics.median(keep), "loss": losses,
            "bytes_sent_per_step": statistics.median(sent[WARMUP:]) if len(sent) > WARMUP else None,
            "state_bytes": state_bytes(model, opt), "peak_tensor_bytes": peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _ddp_loss(ddp, x, y):
    """The model's loss through DDP's forward (so DDP's hooks see the call)."""
    logits = ddp(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _argv(strategy: str, model: ModelConfig, batch_size: int, steps: int, out: Path, world: int):
    def argv(r: int, master: str) -> list[str]:
        return [sys.executable, "-m", "unbroken.plan.native_job", "--strategy", strategy, "--rank", str(r),
                "--world", str(world), "--master", master, "--out", str(out), "--steps", str(steps),
                "--n-layer", str(model.n_layer), "--n-head", str(model.n_head), "--n-embd", str(model.n_embd),
                "--seq-len", str(model.seq_len), "--batch-size", str(batch_size)]
    return argv


def run(strategy: str, world: int, out: Path, *, model: ModelConfig, batch_size: int, steps: int = 12,
        net=None, timeout_s: float = 600.0) -> dict:
    """Train `strategy` on `world` ranks (in `net`'s namespaces, or on loopback); rank 0's file."""
    from unbroken.plan.ranks import run_ranks

    out = Path(out).resolve()
    run_ranks(_argv(strategy, model, batch_size, steps, out, world), world, net=net, timeout_s=timeout_s,
              env={"OMP_NUM_THREADS": "1"}, what=f"native {strategy}")
    return json.loads(out.read_text())


def run_solo(strategy: str, copies: int, out_dir: Path, *, model: ModelConfig, batch_size: int,
             steps: int = 16, timeout_s: float = 600.0) -> float:
    """`copies` independent world-1 jobs at once (they share the host as a job's ranks would),
    communication-free. Returns the median over steps of the slowest copy's step: a synchronous
    step waits for its slowest rank, and on shared cores the ranks do not keep pace."""
    from unbroken.plan.ranks import free_port, run_ranks

    out_dir = Path(out_dir).resolve()

    def argv(r: int, _master: str) -> list[str]:
        one = _argv(strategy, model, batch_size, steps, out_dir / f"solo{r}.json", 1)
        return one(0, f"127.0.0.1:{free_port()}")

    run_ranks(argv, copies, timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1"}, what=f"solo {strategy}")
    per_copy = [json.loads((out_dir / f"solo{r}.json").read_text())["ranks"][0]["step_s"] for r in range(copies)]
    return statistics.median(max(c[i] for c in per_copy) for i in range(min(map(len, per_copy))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", choices=STRATEGIES, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    host, port = a.master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.world, is_master=a.rank == 0,
                          timeout=timedelta(seconds=a.timeout_s), wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=a.timeout_s))
    mine = train(a)
    everyone: list = [None] * a.world
    dist.all_gather_object(everyone, mine)
    if a.rank == 0:
        atomic_write_json(a.out, {"strategy": a.strategy, "world": a.world, "ranks": everyone})
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())  # FSDP2 on gloo sometimes aborts in a destructor after the work is written
