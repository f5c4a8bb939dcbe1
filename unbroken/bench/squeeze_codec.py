"""The codec of squeezed transfers (comm/squeeze.py) on this host: bytes saved and its speed.

`unbroken bench collectives --only codec` writes the `codec` section of collectives.json: per
payload kind, the ratio raw / squeezed bytes and the megabytes per second of raw data that one
core compresses and decodes (median of `reps`). Kinds: normal float32 and bfloat16 values (what
gradients roughly look like, and the bench's payloads), and uniformly random bytes viewed as int64
(no redundancy: the codec's cost with nothing to gain).
"""
from __future__ import annotations

import statistics
import time

import torch

from unbroken.comm import squeeze

KINDS = ("float32", "bfloat16", "random_bytes")


def payload(kind: str, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(52)
    if kind == "random_bytes":
        return torch.randint(0, 256, (max(8, nbytes // 8 * 8),), dtype=torch.uint8, generator=g).view(torch.int64)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kind]
    return torch.randn(max(1, nbytes // dtype.itemsize), generator=g).to(dtype)


def measure(nbytes: int = 16 << 20, reps: int = 5) -> dict:
    torch.set_num_threads(1)
    out = {"bytes": nbytes, "reps": reps, "level": squeeze.LEVEL, "kinds": {}}
    for kind in KINDS:
        x = payload(kind, nbytes)
        raw = x.numel() * x.element_size()
        comp, dec = [], []
        back = torch.empty_like(x)
        for _ in range(reps):
            t0 = time.perf_counter()
            msg = squeeze.squeeze(x)
            comp.append(time.perf_counter() - t0)
            buf = torch.zeros(squeeze.bound(raw), dtype=torch.uint8)
            buf[:msg.numel()] = msg
            t0 = time.perf_counter()
            squeeze.unsqueeze(buf, back)
            dec.append(time.perf_counter() - t0)
        if not torch.equal(back.view(torch.uint8), x.view(torch.uint8)):
            raise RuntimeError(f"codec: {kind} did not decode to its own bits")
        out["kinds"][kind] = {"ratio": raw / msg.numel(), "compress_MBps": raw / statistics.median(comp) / 1e6,
                              "decode_MBps": raw / statistics.median(dec) / 1e6}
    return out
