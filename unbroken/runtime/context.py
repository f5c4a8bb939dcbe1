"""What a worker or shadow process learns from its environment, and its heartbeat.

The supervisor starts each process with torchrun-style variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK) plus UNBROKEN_PROC (a unique
process name), UNBROKEN_ROLE (worker|shadow) and UNBROKEN_RUN_DIR.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from unbroken.config import RunConfig
from unbroken.events import EventLog
from unbroken.runtime import membership
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
        proc = os.environ.get("UNBROKEN_PROC", f"n{node}-r{rank}")
        events = EventLog(run_dir / "events.jsonl", source=role, rank=rank, node=node)
        specs = [FaultSpec.parse(s) for s in json.loads(os.environ.get("UNBROKEN_FAULTS", "[]"))]
        faults = FaultInjector(specs, claim=lambda i: store.add(f"fault/{i}", 1) == 1)
        return ProcessContext(proc=proc, role=role, rank=rank, node=node, run_dir=run_dir, config=config,
                              store=store, host=host, port=port, events=events, faults=faults)

    def set_phase(self, phase: str, step: int | None = None) -> None:
        self.phase["phase"] = phase
        if step is not None:
            self.phase["step"] = step

    def start_heartbeat(self) -> threading.Thread:
        """A daemon thread with its own store connection; SIGSTOP freezes it with the process."""
        store = membership.connect_store(self.host, self.port, timeout_s=self.config.collective_timeout_s)
        interval = self.config.heartbeat_s

        def beat() -> None:
            while True:
                try:
                    membership.put(store, f"hb/{self.proc}", {**self.phase, "t": time.time(), "pid": os.getpid()})
                except RuntimeError:
                    return  # the store is gone: the run is over
                time.sleep(interval)

        t = threading.Thread(target=beat, name="unbroken-heartbeat", daemon=True)
        t.start()
        return t
