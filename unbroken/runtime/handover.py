"""The end of a multi-node job: every node's events reach node 0, node 0's summary reaches every node.

Each node has its own run directory (its own disk). At the end the followers hand their
`events.jsonl` to the leader through the store; the leader keeps each as
`events-node{N}.jsonl` beside its own (skipped when the directory is shared, i.e. its own
file already holds that node's events), summarizes the whole job, and hands the summary
back, so every node's `summary.json` says the same thing. Every wait is bounded.
"""
from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from unbroken.events import node_events_path, read_events
from unbroken.fsutil import atomic_write_bytes

_EVENTS_KEY = "final/events/{}"
_SUMMARY_KEY = "final/summary"


def send_events(store: dist.Store, node: int, run_dir: Path) -> None:
    """A follower's whole events file, compressed (JSON lines compress ~10x)."""
    path = run_dir / "events.jsonl"
    raw = path.read_bytes() if path.exists() else b""
    store.set(_EVENTS_KEY.format(node), zlib.compress(raw, 6))


def collect_events(store: dist.Store, nodes: list[int], run_dir: Path, *, timeout_s: float) -> list[int]:
    """Write each follower's events beside the leader's; returns the nodes that did not send in time."""
    own_nodes = {e.node for e in read_events(run_dir)} if (run_dir / "events.jsonl").exists() else set()
    deadline = time.monotonic() + timeout_s
    missing = []
    for n in nodes:
        key = _EVENTS_KEY.format(n)
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not store.check([key]):
            missing.append(n)
            continue
        if n in own_nodes:  # one directory shared by the nodes: their events are in events.jsonl already
            continue
        atomic_write_bytes(node_events_path(run_dir, n), zlib.decompress(store.get(key)))
    return missing


def publish_summary(store: dist.Store, summary: dict | None) -> None:
    """None: the job did not finish (the followers then write no summary either)."""
    store.set(_SUMMARY_KEY, json.dumps(summary))


def receive_summary(store: dist.Store, *, timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> dict | None:
    """The leader's summary, or None if it published none within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([_SUMMARY_KEY]):
        if time.monotonic() >= deadline or stopped():
            return None
        time.sleep(0.02)
    return json.loads(store.get(_SUMMARY_KEY))
