"""How a node's supervisor is asked to run: the launch options, checked at construction.

Also the one warning every job that spans nodes (or listens beyond loopback) prints at
start: the job's store is TCPStore, neither authenticated nor encrypted (README: trust
boundary).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unbroken.runtime.faults import FaultSpec
from unbroken.runtime.tee import parse_tee

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchError(RuntimeError):
    """The job cannot start as asked (port in use, join refused, ...)."""


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    script: tuple[str, ...] = ("unbroken.jobs.tiny_gpt",)
    run_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    faults: tuple[FaultSpec, ...] = ()
    resume: bool = False  # generation 0 starts from the newest valid tier-2 checkpoint (runtime/resume.py)
    tee: str = "0"  # whose output the console shows: all, none or ranks like 0,3 (runtime/tee.py)
    store: str | None = None  # etcd://...: the replicated store (runtime/etcd_store.py); None: node 0's TCPStore

    def __post_init__(self) -> None:
        parse_tee(self.tee)  # ValueError naming --tee
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be within 0..nnodes-1, got node_rank={self.node_rank} nnodes={self.nnodes}")
        if self.host not in _LOOPBACK and not self.token:
            raise ValueError(f"binding to {self.host} (not loopback) needs a join token: pass --token-file or set UNBROKEN_TOKEN")
        if self.store is not None:
            from unbroken.runtime.etcd_store import EtcdSpec

            EtcdSpec.parse(self.store)  # StoreUrlError (a ValueError) naming --store
        elif self.nnodes > 1 and self.node_rank > 0 and not self.port:
            raise ValueError("a joining node needs node 0's port: pass --port or MASTER_PORT")


def trust_warning(opts: LaunchOptions) -> str | None:
    """The store is TCPStore: neither authenticated nor encrypted. Said at the start of every
    job that listens beyond loopback or spans nodes (README: trust boundary)."""
    if opts.nnodes == 1 and opts.host in _LOOPBACK and opts.store is None:
        return None
    if opts.store is not None:
        return (f"the job's store {opts.store} (etcd, plain HTTP) is not authenticated or encrypted: anyone who "
                "can reach it can disturb the job; run multi-node jobs only on a private network")
    return (f"the job's store at {opts.host} (TCPStore) is not authenticated or encrypted: anyone who can "
            "reach it can disturb the job; run multi-node jobs only on a private network (the join token "
            "admits nodes, it does not protect the store)")
