"""What a process holds in memory: its peak resident set and the bytes of the tensors it keeps.

Both sides of a memory comparison (an unbroken rank, its torch peer) measure the same way:
`peak_rss_bytes` is the kernel's high-water mark of the process; `live_tensor_bytes` adds
up every distinct tensor storage reachable from Python objects (parameters, gradients,
optimizer state, communication and protection buffers), each counted once however many
views point into it.
"""
from __future__ import annotations

import gc
import resource
import warnings

import torch


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports it in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def live_tensor_bytes(extra: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see, plus
    `extra` (tensors held only by C++ objects, e.g. a module's gradients)."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on a deprecated alias object warns: not the user's business
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in [*objects, *extra]:
        try:
            t = obj._local_tensor if hasattr(obj, "_local_tensor") else obj  # a DTensor: its local shard
            storage = t.untyped_storage()
        except (RuntimeError, ReferenceError, TypeError):
            continue
        if storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
