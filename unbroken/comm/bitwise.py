"""XOR and AND reductions without bitwise reduce ops: data movement plus a local torch bitwise op.

NCCL has no ReduceOp.BXOR or BAND. All-reduce = reduce-scatter by one all-to-all, a local
fold of the `world` pieces, then an all-gather (the same bytes a ring all-reduce moves);
reduce to one rank = a gather to it, then a local fold (one op, so it can stay in flight
while the caller does other work, as the decode does). Both work on any backend, so the
path is tested on gloo against gloo's own BXOR/BAND.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unbroken.config import BITWISE_REDUCE

if TYPE_CHECKING:
    from unbroken.comm.group import Comm, Pending

BITWISE_MODES = BITWISE_REDUCE  # auto: the backend's BXOR/BAND where it has them
OPS = ("xor", "and")


def int_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat integer tensor (int64, int32 or uint8: the widest its size and offset allow), no copy."""
    if not t.is_contiguous():
        raise ValueError(f"bitwise reductions need a contiguous tensor, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}; pass t.contiguous() and copy the result back")
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    for dtype in (torch.int64, torch.int32):  # gloo's all-to-all has no int16
        width = dtype.itemsize
        if (flat.numel() * flat.element_size()) % width == 0 and (flat.storage_offset() * flat.element_size()) % width == 0:
            try:
                return flat.view(dtype)
            except RuntimeError:  # an alignment the view cannot take: try a narrower type
                continue
    return flat.view(torch.uint8)


def fold(rows: torch.Tensor, op: str) -> torch.Tensor:
    """XOR (or AND) of the rows of `rows` (first dimension), as a new tensor."""
    _check_op(op)
    acc = rows[0].clone()
    for r in rows[1:]:
        acc.bitwise_xor_(r) if op == "xor" else acc.bitwise_and_(r)
    return acc


def allreduce(comm: "Comm", t: torch.Tensor, op: str, what: str) -> None:
    """Every rank's `t` becomes the XOR (AND) of all ranks' `t`: one all-to-all, a fold, one all-gather."""
    _check_op(op)
    flat, w = int_view(t), comm.world
    n = flat.numel()
    if w == 1 or n == 0:
        return
    part = -(-n // w)  # the last piece is padded; padding lanes are dropped at the end
    send = torch.zeros(w * part, dtype=flat.dtype, device=flat.device)
    send[:n].copy_(flat)
    got = torch.empty_like(send)
    comm.finish(comm.alltoall_start(got.view(w, part), send.view(w, part), what=f"{what} (scatter)"))
    mine = fold(got.view(w, part), op)
    comm.allgather_into(send, mine, what=f"{what} (gather)")
    flat.copy_(send[:n])


def reduce_start(comm: "Comm", t: torch.Tensor, dst: int, op: str, what: str) -> "Pending":
    """Rank `dst`'s `t` becomes the XOR (AND) of all ranks' `t` when the returned op is finished
    (`comm.finish`); the others' `t` are left as they were. One gather, then a fold at `dst`."""
    _check_op(op)
    flat = int_view(t)
    rows = torch.empty((comm.world, flat.numel()), dtype=flat.dtype, device=flat.device) if comm.rank == dst else None
    p = comm.gather_start(rows, flat, dst, what=what)
    if rows is not None:
        p.after = lambda: flat.copy_(fold(rows, op))
    return p


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"bitwise op must be one of {', '.join(OPS)}, got {op!r}")
