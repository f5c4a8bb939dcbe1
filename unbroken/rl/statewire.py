"""A process's weights and optimizer state as they travel to a training generation's joiners: one
flat byte tensor holding every tensor (each at an 8-byte aligned offset) and a small JSON layout,
the state dicts with each tensor replaced by its place in the flat one (tagged, so that integer
keys and tuples come back as they were; no pickle: nothing but data crosses). Packing is one copy;
unpacking makes views, which `load_state_dict` copies into the model (the optimizer keeps them).
At 0.8M parameters with Adam, packing takes ~4 ms where torch.save and torch.load took ~28 ms at
a full core (docs/rl.md)."""
from __future__ import annotations

import json
import math

import torch

_ALIGN = 8


def pack(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[bytes, torch.Tensor]:
    """(layout, flat uint8 tensor) of {"model": model.state_dict(), "opt": opt.state_dict()}."""
    chunks: list[torch.Tensor] = []
    size = 0

    def strip(x):
        nonlocal size
        if torch.is_tensor(x):
            raw = x.detach().reshape(-1).contiguous().view(torch.uint8)
            slot = {"T": [size, list(x.shape), str(x.dtype).removeprefix("torch.")]}
            pad = -raw.numel() % _ALIGN
            chunks.extend([raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw])
            size += raw.numel() + pad
            return slot
        if isinstance(x, dict):
            return {"D": [[k, strip(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"L" if isinstance(x, list) else "U": [strip(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot send a {type(x).__name__} in a training state (tensors, numbers, strings, "
                        f"dicts, lists, tuples)")

    layout = strip({"model": model.state_dict(), "opt": opt.state_dict()})
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return json.dumps(layout).encode(), flat


def unpack_into(model: torch.nn.Module, opt: torch.optim.Optimizer, layout: bytes, flat: torch.Tensor) -> None:
    """Load what `pack` made into `model` and `opt` (same architecture, same optimizer class)."""
    def fill(x):
        if not isinstance(x, dict):
            return x
        (tag, v), = x.items()
        if tag == "T":
            offset, shape, dtype = v
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"a training state names an unknown dtype {dtype!r}")
            n = dt.itemsize * math.prod(shape)
            return flat[offset:offset + n].view(dt).view(shape)
        if tag == "D":
            return {k: fill(item) for k, item in v}
        return (list if tag == "L" else tuple)(fill(item) for item in v)

    state = fill(json.loads(layout))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
