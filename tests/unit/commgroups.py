"""Test helper: real gloo groups of 2..8 ranks in this process (one thread per rank, loopback)."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from unbroken.comm.transport import Transport

_groups: dict[int, list] = {}


def groups(world: int) -> list:
    """`world` connected ProcessGroupGloo objects (cached per world size: a rendezvous costs time)."""
    if world not in _groups:
        _groups[world] = fresh_groups(world)
    return _groups[world]


def fresh_groups(world: int) -> list:
    """`world` newly connected ProcessGroupGloo objects, not shared with other tests."""
    store, pgs, errors = dist.HashStore(), [None] * world, []

    def connect(r: int) -> None:
        try:
            pgs[r] = dist.ProcessGroupGloo(store, r, world, timedelta(seconds=20))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=connect, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(pgs), f"gloo rendezvous of {world} ranks failed: {errors}"
    return pgs


def on_ranks(world: int, fn, *, timeout_s: float = 20.0, on_transfer=None) -> list:
    """fn(transport, rank) on every rank at once (threads); its results in rank order; raises its first error."""
    pgs = groups(world)
    out, errors = [None] * world, []

    def body(r: int) -> None:
        try:
            tp = Transport(pgs[r], rank=r, world=world, timeout_s=timeout_s,
                           on_transfer=on_transfer(r) if on_transfer else None)
            out[r] = fn(tp, r)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return out
