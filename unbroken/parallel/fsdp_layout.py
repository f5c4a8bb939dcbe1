"""Where FSDP2's shard of each parameter lies inside a rank's owned parameter shard.

`fully_shard` splits every parameter on dim 0 as `torch.chunk` does: with c = ceil(d0 / world)
rows per chunk, rank r holds rows [r*c, (r+1)*c) (fewer, or none, at the end), padded to c rows.
unbroken's `fsdp` strategy owns the concatenation of those padded slots, in the trained
parameters' order: slot i is c_i * (elements per row) long on every rank, so every rank's shard
has the same size and the same chunking, parity and transactions as zero3's apply to it. The
padding rows of a slot hold zeros and belong to no optimizer run (they are never updated).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    offset: int   # start of the parameter's slot in the owned shard
    size: int     # c * row elements: the padded local shard, the same on every rank
    rows: int     # c
    row: int      # elements per dim-0 row
    d0: int       # the parameter's dim-0 length

    def local_rows(self, rank: int) -> int:
        return max(0, min(self.rows, self.d0 - rank * self.rows))


class FsdpLayout:
    """The slots of `shapes` (the trained parameters, in order) for `world` ranks."""

    def __init__(self, shapes: list[torch.Size], names: list[str], world: int) -> None:
        self.world = world
        self.slots: list[Slot] = []
        off = 0
        for shape, name in zip(shapes, names):
            if len(shape) == 0:
                raise ValueError(f"--strategy fsdp shards every parameter on dim 0 (FSDP2's rule), but {name!r} is a "
                                 "scalar; make it a 1-element tensor or use --strategy zero3")
            rows = math.ceil(shape[0] / world)
            row = math.prod(shape[1:])
            self.slots.append(Slot(off, rows * row, rows, row, shape[0]))
            off += rows * row
        self.size = off  # elements of one rank's shard (before chunk padding)

    def local_numel(self, i: int, rank: int) -> int:
        s = self.slots[i]
        return s.local_rows(rank) * s.row

    def runs(self, rank: int, group_of: list[int]) -> list[tuple[int, int, int]]:
        """(start, end, param group) of the elements rank `rank` updates, shard-relative, merged
        where neighbours share a group (a slot's padding breaks a run)."""
        runs: list[tuple[int, int, int]] = []
        for i, (s, g) in enumerate(zip(self.slots, group_of)):
            k = self.local_numel(i, rank)
            if not k:
                continue
            if runs and runs[-1][1] == s.offset and runs[-1][2] == g:
                runs[-1] = (runs[-1][0], s.offset + k, g)
            else:
                runs.append((s.offset, s.offset + k, g))
        return runs

    def shard_from_full(self, full: torch.Tensor, shard: torch.Tensor, rank: int) -> None:
        """Fill `shard` (this rank's slots, padding zero) from the flat full parameters `full`."""
        shard.zero_()
        src = 0
        for i, s in enumerate(self.slots):
            k = self.local_numel(i, rank)
            first = src + rank * s.rows * s.row
            shard[s.offset:s.offset + k].copy_(full[first:first + k])
            src += s.d0 * s.row

    def full_from_slots(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i in full from its slot all-gathered over the ranks ((world * size,)): the
        chunks are in rank order and only the last real one is short, so the parameter is the
        first d0 rows."""
        s = self.slots[i]
        return gathered[:s.d0 * s.row]
