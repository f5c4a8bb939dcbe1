"""One server process: `python -m unbroken.serve.server --port P --adapters DIR [...]` (what
`unbroken serve run` and the fleet start). SIGTERM stops it cleanly."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from aiohttp import web

from unbroken.config import ConfigError
from unbroken.serve.api import build_app
from unbroken.serve.config import ServeConfig
from unbroken.serve.engine import Engine


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="unbroken.serve.server")
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    for name, d in (("max_batch", 8), ("slots", 4), ("max_rank", 16), ("max_waiting", 256)):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d)
    p.add_argument("--memory-mb", type=float, default=64.0)
    return p.parse_args(argv)


def config_from(a) -> ServeConfig:
    return ServeConfig(max_batch=a.max_batch, slots=a.slots, max_rank=a.max_rank, max_waiting=a.max_waiting,
                       memory_mb=a.memory_mb)


def serve(cfg: ServeConfig, adapters: Path, host: str, port: int) -> None:
    torch.set_num_threads(1)  # one core per server: a fleet shares the machine's cores
    web.run_app(build_app(Engine(cfg, adapters)), host=host, port=port, print=None, handle_signals=True)


def main(argv: list[str] | None = None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not a.adapters.is_dir():
        print(f"error: --adapters {a.adapters} is not a directory: create adapters with `unbroken serve adapters`",
              file=sys.stderr)
        sys.exit(2)
    serve(cfg, a.adapters, a.host, a.port)


if __name__ == "__main__":
    main()
