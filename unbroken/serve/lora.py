"""Batched multi-adapter LoRA (Punica-style gather): every row of a batch uses its own adapter slot
in one forward pass; a naive per-row reference to test it against."""
from __future__ import annotations

import torch
import torch.nn as nn


class SlotTable:
    """The resident adapters' weights, per target module: A (slots+1, r_max, in), B (slots+1, out, r_max);
    slot 0 is the base model (all zeros). `rows`/`rank` say which slot each batch row uses."""

    def __init__(self, targets: dict[str, tuple[int, int]], slots: int, max_rank: int) -> None:
        self.a = {m: torch.zeros(slots + 1, max_rank, i) for m, (i, o) in targets.items()}
        self.b = {m: torch.zeros(slots + 1, o, max_rank) for m, (i, o) in targets.items()}
        self.scale = torch.zeros(slots + 1)
        self.ranks = [0] * (slots + 1)
        self.rows = torch.zeros(0, dtype=torch.long)
        self.rank = 0  # the largest rank among this batch's rows: gathered weights are sliced to it

    def put(self, slot: int, adapter) -> None:
        assert slot >= 1, "slot 0 is the base model"
        for m, (a, b) in adapter.weights.items():
            self.a[m][slot].zero_()
            self.b[m][slot].zero_()
            self.a[m][slot, :adapter.rank] = a
            self.b[m][slot, :, :adapter.rank] = b
        self.scale[slot] = adapter.scale
        self.ranks[slot] = adapter.rank

    def use(self, rows: list[int]) -> None:
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.rank = max((self.ranks[s] for s in rows), default=0)


class BatchedLoRALinear(nn.Module):
    """base(x) + scale[row] * (x @ A[row].T) @ B[row].T, with A/B gathered per row (one bmm each)."""

    def __init__(self, base: nn.Linear, name: str, table: SlotTable) -> None:
        super().__init__()
        self.base, self.name, self.table = base, name, table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        t = self.table
        if t.rank == 0:
            return y
        a = t.a[self.name].index_select(0, t.rows)[:, :t.rank]  # (b, r, in)
        b = t.b[self.name].index_select(0, t.rows)[:, :, :t.rank]  # (b, out, r)
        low = torch.bmm(x, a.transpose(1, 2)) * t.scale.index_select(0, t.rows)[:, None, None]
        return y + torch.bmm(low, b.transpose(1, 2))


def inject(model: nn.Module, table: SlotTable) -> nn.Module:
    """Wrap every target linear of `model` (in place) so that its rows use their slots in `table`."""
    for name in table.a:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, BatchedLoRALinear(getattr(parent, child), name, table))
    return model


def reference_forward(model: nn.Module, table: SlotTable, idx: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The naive way: one forward per row, each with only its own adapter (for tests)."""
    outs = []
    for i, slot in enumerate(rows):
        table.use([slot])
        outs.append(model(idx[i:i + 1]))
    table.use(rows)
    return torch.cat(outs)
