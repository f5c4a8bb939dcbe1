"""Heartbeats stay on their node: each supervisor hosts a loopback TCPStore for its own children.

A worker or shadow beats every `heartbeat_s` (0.1 s) and its supervisor reads the beats of its
own children only, so the beats never need the job's store. On the job's store they cost a
network round trip per beat for another node's processes, and on the replicated store (etcd)
a raft proposal each, replicated to every member: seven processes at 10 Hz were most of what
the etcd store cost per step. So the supervisor starts this store before its children and names
its port in UNBROKEN_HEARTBEAT_PORT; a process started without it (tests that build a context
directly) beats into the job's store as before.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from unbroken.runtime import membership

ENV = "UNBROKEN_HEARTBEAT_PORT"


class NodeHeartbeats:
    """The node's heartbeat store, listening on loopback only (TCPStore alone binds every
    interface: membership.listen_store binds the socket itself); `port` for the children."""

    def __init__(self, timeout_s: float) -> None:
        self.store, self._listener = membership.listen_store("127.0.0.1", 0, timeout_s=timeout_s)
        self.port = self.store.port


def host(timeout_s: float) -> NodeHeartbeats:
    """The node's heartbeat store, on a free loopback port (`.port`)."""
    return NodeHeartbeats(timeout_s)


def connect(timeout_s: float, fallback: Callable[[], dist.Store]) -> dist.Store:
    """A client of this node's heartbeat store, or `fallback()` (the job's store) when none is named."""
    port = os.environ.get(ENV)
    if not port:
        return fallback()
    return dist.TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False, use_libuv=True,
                         timeout=timedelta(seconds=timeout_s))
