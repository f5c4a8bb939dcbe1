"""What a worker or shadow process learns from its environment, and its heartbeat.

The supervisor starts each process with torchrun-style variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK) plus UNBROKEN_PROC (a unique
process name), UNBROKEN_ROLE (worker|shadow) and UNBROKEN_RUN_DIR. The heartbeat
rides out store errors (`beat_until_unreachable`); only a sustained outage stops it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from unbroken.config import RunConfig
from unbroken.events import EventLog
from unbroken.runtime import membership, node_heartbeats
from unbroken.runtime.faults import FaultInjector, FaultSpec


@dataclass
class ProcessContext:
    proc: str
    role: str
    rank: int | None
    node: int
    run_dir: Path
    config: RunConfig
    store: dist.Store
    host: str
    port: int
    events: EventLog
    faults: FaultInjector
    nnodes: int = 1
    resume: bool = False  # `unbroken run --resume`: generation 0 starts from the newest valid tier-2 checkpoint
    phase: dict = field(default_factory=lambda: {"step": 0, "phase": "init", "gen": 0, "rank": None})

    @staticmethod
    def from_env() -> "ProcessContext":
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "UNBROKEN_RUN_DIR") if k not in os.environ]
        if missing:
            raise RuntimeError(f"unbroken.Trainer must run under `unbroken run` (missing {', '.join(missing)}); "
                               "launch your script with: unbroken run --world-size 4 your_script.py")
        run_dir = Path(os.environ["UNBROKEN_RUN_DIR"])
        config = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = membership.connect_store(host, port, timeout_s=config.collective_timeout_s)
        role = os.environ.get("UNBROKEN_ROLE", "worker")
        rank = int(os.environ["RANK"]) if role == "worker" else None
        node = int(os.environ.get("NODE_RANK", "0"))
        nnodes = int(os.environ.get("NNODES", "1"))
        proc = os.environ.get("UNBROKEN_PROC", f"n{node}-r{rank}")
        events = EventLog(run_dir / "events.jsonl", source=role, rank=rank, node=node)
        specs = [FaultSpec.parse(s) for s in json.loads(os.environ.get("UNBROKEN_FAULTS", "[]"))]
        faults = FaultInjector(specs, claim=lambda i: store.add(f"fault/{i}", 1) == 1)
        return ProcessContext(proc=proc, role=role, rank=rank, node=node, nnodes=nnodes, run_dir=run_dir, config=config,
                              store=store, host=host, port=port, events=events, faults=faults,
                              resume=os.environ.get("UNBROKEN_RESUME") == "1")

    def set_phase(self, phase: str, step: int | None = None) -> None:
        self.phase["phase"] = phase
        if step is not None:
            self.phase["step"] = step

    def start_heartbeat(self) -> threading.Thread:
        """A daemon thread with its own store connection; SIGSTOP freezes it with the process.

        A store error does not stop it (a dead heartbeat gets a healthy worker killed as
        hung): it reconnects and retries with backoff, and gives up only once the store has
        been unreachable for `collective_timeout_s` (the run is over)."""
        cfg = self.config
        store = node_heartbeats.connect(cfg.collective_timeout_s, lambda: membership.connect_store(
            self.host, self.port, timeout_s=cfg.collective_timeout_s))

        def send(client: dist.Store) -> None:
            membership.put(client, f"hb/{self.proc}", {**self.phase, "t": time.time(), "pid": os.getpid()})

        def connect() -> dist.Store:
            # A short timeout: a reconnect that cannot finish within a hang timeout is a failed attempt.
            return node_heartbeats.connect(cfg.hang_timeout_s, lambda: membership.connect_store(
                self.host, self.port, timeout_s=cfg.hang_timeout_s))

        t = threading.Thread(target=beat_until_unreachable, args=(send, connect, store),
                             kwargs={"interval_s": cfg.heartbeat_s, "give_up_s": cfg.collective_timeout_s},
                             name="unbroken-heartbeat", daemon=True)
        t.start()
        return t


# A TCPStore raises DistStoreError / DistNetworkError (RuntimeErrors); sockets may raise OSError.
_STORE_ERRORS = (RuntimeError, OSError)


def beat_until_unreachable(send: Callable[[Any], None], connect: Callable[[], Any], client: Any, *,
                           interval_s: float, give_up_s: float, max_backoff_s: float = 1.0,
                           sleep: Callable[[float], None] = time.sleep,
                           clock: Callable[[], float] = time.monotonic) -> Exception:
    """`send(client)` every `interval_s`, forever. After a failure: wait (from `interval_s`,
    doubling, capped at max(interval_s, max_backoff_s)), reconnect, retry. Returns the last
    error once every attempt has failed for `give_up_s` in a row."""
    cap = max(interval_s, max_backoff_s)
    delay, failing_since = interval_s, None
    while True:
        try:
            if client is None:
                client = connect()
            send(client)
        except _STORE_ERRORS as e:
            now = clock()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= give_up_s:
                return e
            client = None  # a client that failed once may be wedged: the next attempt reconnects
            sleep(delay)
            delay = min(2 * delay, cap)
            continue
        failing_since, delay = None, interval_s
        sleep(interval_s)
