"""`unbroken serve`: run one server, write synthetic PEFT adapters, run a fleet behind the router.

    unbroken serve adapters --out DIR --count 24 [--alpha 1.0] [--seed 7]
    unbroken serve run --adapters DIR [--port 8000] [--max-batch 8] [--slots 4] [--max-rank 16]
    unbroken serve fleet --adapters DIR --servers 2 [--port 8000]   (router on --port, servers after it)
"""
from __future__ import annotations

import threading
from pathlib import Path

import typer

from unbroken.cli_error import fail
from unbroken.config import ConfigError

serve_app = typer.Typer(no_args_is_help=True, help="Multi-adapter LoRA serving of the tiny GPT (HTTP, loopback).")


def _config(max_batch: int, slots: int, max_rank: int, memory_mb: float):
    from unbroken.serve.config import ServeConfig

    try:
        return ServeConfig(max_batch=max_batch, slots=slots, max_rank=max_rank, memory_mb=memory_mb)
    except ConfigError as e:
        fail(str(e))


def _adapter_dir(adapters: Path) -> Path:
    if not adapters.is_dir():
        fail(f"--adapters {adapters} is not a directory: write some with `unbroken serve adapters --out {adapters}`")
    return adapters


@serve_app.command("adapters")
def adapters_cmd(out: Path = typer.Option(..., "--out", help="directory to write PEFT adapters into"),
                 count: int = typer.Option(24, "--count"), alpha: float = typer.Option(1.0, "--alpha"),
                 seed: int = typer.Option(7, "--seed")) -> None:
    """Write `count` synthetic LoRA adapters (PEFT format, mixed ranks) for the served base model."""
    from unbroken.serve.adapters import write_adapter
    from unbroken.serve.config import serve_model
    from unbroken.serve.workload import AdapterSet

    try:
        s = AdapterSet.zipf(count, alpha, seed=seed)
    except ConfigError as e:
        fail(str(e))
    for i, (name, rank) in enumerate(zip(s.names, s.ranks)):
        write_adapter(out, name, model=serve_model(), rank=rank, seed=seed * 1000 + i)
    typer.echo(f"wrote {count} adapters to {out} (ranks {sorted(set(s.ranks))})")


@serve_app.command("run")
def run_cmd(adapters: Path = typer.Option(..., "--adapters"), port: int = typer.Option(8000, "--port"),
            max_batch: int = typer.Option(8, "--max-batch"), slots: int = typer.Option(4, "--slots"),
            max_rank: int = typer.Option(16, "--max-rank"), memory_mb: float = typer.Option(64.0, "--memory-mb")) -> None:
    """One server on 127.0.0.1:PORT (POST /v1/completions, GET /metrics); Ctrl-C stops it."""
    from unbroken.serve.server import serve

    cfg = _config(max_batch, slots, max_rank, memory_mb)
    typer.echo(f"serving on http://127.0.0.1:{port}")
    serve(cfg, _adapter_dir(adapters), "127.0.0.1", port)


@serve_app.command("fleet")
def fleet_cmd(adapters: Path = typer.Option(..., "--adapters"), servers: int = typer.Option(2, "--servers"),
              port: int = typer.Option(8000, "--port"), max_batch: int = typer.Option(8, "--max-batch"),
              slots: int = typer.Option(4, "--slots"), max_rank: int = typer.Option(16, "--max-rank"),
              memory_mb: float = typer.Option(64.0, "--memory-mb")) -> None:
    """`servers` server processes (ports PORT+1..) behind a router on PORT; adapters round-robin."""
    from unbroken.serve.background import BackgroundApp
    from unbroken.serve.fleet import Fleet
    from unbroken.serve.router import Router, build_router_app

    if not 1 <= servers <= 16:
        fail(f"--servers must be 1..16, got {servers}")
    cfg = _config(max_batch, slots, max_rank, memory_mb)
    names = sorted(p.parent.name for p in _adapter_dir(adapters).glob("*/adapter_config.json"))
    if not names:
        fail(f"no adapters under {adapters}: write some with `unbroken serve adapters --out {adapters}`")
    with Fleet(adapters, [port + 1 + i for i in range(servers)], cfg) as urls:
        router = Router({n: [urls[i % servers]] for i, n in enumerate(names)})
        with BackgroundApp(build_router_app(router), port) as url:
            typer.echo(f"router on {url} over {servers} servers; Ctrl-C stops all")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
