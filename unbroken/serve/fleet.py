"""A fleet of server processes on loopback: started together, ready when each answers /health,
always stopped and reaped (SIGTERM, then SIGKILL) by whoever started them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from unbroken.serve.config import ServeConfig

READY_TIMEOUT_S = 90.0


class Fleet:
    """`with Fleet(n, adapter_dir, ports, cfg) as urls:` n servers at http://127.0.0.1:port."""

    def __init__(self, adapter_dir: Path, ports: list[int], cfg: ServeConfig, log_dir: Path | None = None) -> None:
        self.adapter_dir, self.ports, self.cfg, self.log_dir = Path(adapter_dir), ports, cfg, log_dir
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> list[str]:
        try:
            for port in self.ports:
                self.procs.append(self._start(port))
            deadline = time.monotonic() + READY_TIMEOUT_S
            for url, p in zip(self.urls, self.procs):
                _wait_ready(url, p, deadline)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, port: int) -> subprocess.Popen:
        c = self.cfg
        cmd = [sys.executable, "-m", "unbroken.serve.server", "--adapters", str(self.adapter_dir), "--port", str(port),
               "--max-batch", str(c.max_batch), "--slots", str(c.slots), "--max-rank", str(c.max_rank),
               "--max-waiting", str(c.max_waiting), "--memory-mb", str(c.memory_mb)]
        log = open(self.log_dir / f"server-{port}.log", "wb") if self.log_dir else subprocess.DEVNULL
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        finally:
            if self.log_dir:
                log.close()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs = []


def _wait_ready(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server {url} not ready within {READY_TIMEOUT_S}s")
        time.sleep(0.1)
