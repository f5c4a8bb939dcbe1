"""The flow exchange of the adaptive all-reduce: what one rank's transfers saw, shared with every rank.

During a collective each rank keeps, per peer and tag phase, four numbers of its own transfers
(`FlowSync.record`, the transport's `on_transfer`): bytes received, when the first receive was
posted, when the last one ended, and when the first send was posted. After the collective every
rank issues one all-gather of those slots and the collective's seconds and returns (`start`): it
travels while the caller computes, and the next collective waits for it (`finish`), so every rank
folds the same flows (`flows_of`) into the same estimates (comm/adaptive.py). Every rank issues it
at the same point of the group's op sequence, so other collectives on the group keep their order.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from unbroken.comm import flows
from unbroken.comm.patterns import PHASE_RESULTS

PHASES = 4  # tag phases: reduce-scatter rows, all-gather results, tree up, tree down


class FlowSync:
    """The slots of the collective in hand on one rank of `world`, and the all-gather in flight."""

    def __init__(self, pg, *, world: int, timeout_s: float) -> None:
        self.pg, self.world, self.timeout_s = pg, world, timeout_s
        self.slots = self._empty()
        self.pending: tuple | None = None  # the exchange in flight: (work, output, input)

    def _empty(self) -> list[list[list[float]]]:
        return [[[0.0] * 4 for _ in range(PHASES)] for _ in range(self.world)]

    def reset(self) -> None:
        """A new collective: nothing seen yet."""
        self.slots = self._empty()

    def record(self, kind: str, peer: int, tag: int, nbytes: int, posted: float, ended: float) -> None:
        phase = (tag >> 18) & 3
        if phase == PHASE_RESULTS:  # paced by the owners' reductions, not by the link: no rate
            return
        s = self.slots[peer][phase]
        if kind == "send":
            s[3] = posted if s[3] == 0 else min(s[3], posted)
            return
        s[1] = posted if s[0] == 0 else min(s[1], posted)
        s[2] = max(s[2], ended)
        s[0] += nbytes

    def start(self, seconds: float) -> None:
        """Issue the all-gather of every rank's slots (world, PHASES, 4) and `seconds`, and return
        (RuntimeError where gloo refuses it)."""
        mine = torch.tensor([*(x for peer in self.slots for ph in peer for x in ph), seconds], dtype=torch.float64)
        out = torch.empty((self.world, mine.numel()), dtype=torch.float64)
        work = self.pg.allgather([[out[r] for r in range(self.world)]], [mine])
        self.pending = (work, out, mine)

    def finish(self) -> tuple[torch.Tensor, float]:
        """The slots (world, world, PHASES, 4) of the exchange `start` issued and the slowest rank's
        seconds; bounded by `timeout_s` (RuntimeError past it, or when a peer's socket fails)."""
        work, out, _ = self.pending
        self.pending = None
        work.wait(timedelta(seconds=self.timeout_s))
        return out[:, :-1].reshape(self.world, self.world, PHASES, 4), float(out[:, -1].max())


def flows_of(slots: torch.Tensor) -> list[flows.Flow]:
    """The collective's flows from every rank's slots (rank j's row: what j received and sent)."""
    recvs, sends = [], []
    rows = slots.tolist()  # one conversion: indexing a tensor element by element costs microseconds each
    for j, row in enumerate(rows):
        for i, peer in enumerate(row):
            for ph, (nb, posted, ended, sent) in enumerate(peer):
                if nb > 0:
                    recvs.append((i, j, ph, int(nb), posted, ended))
                if sent > 0:
                    sends.append((j, i, ph, sent))
    return flows.join(recvs, sends)
