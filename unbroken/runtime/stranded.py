"""A recovery nobody can join: ranks lost after their peers already finished the job.

A rank that wrote its done record (runtime/worker.py `finish`) has left for good: a generation
that needs it never forms, so replacing a rank lost after that point would wait forever. The
leader notices (`Stranding.check`), stops replacing, and ends the job on what is committed:
every rank completed the last step's collectives, so the final weights are those the finished
ranks hold; the job *finishes* if they were written (rank 0 writes them) and *fails* with a
one-line reason otherwise. Either way within a bounded wait, as one `recovery_abandoned` event.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from unbroken.runtime.options import LaunchError


@dataclass(frozen=True)
class Ending:
    """How a stranded recovery ends: `outcome` "finish" (the job is done) or "fail" (`reason` says why)."""

    outcome: str
    reason: str
    lost: tuple[int, ...]
    finished: tuple[int, ...]
    step: int

    def event_fields(self) -> dict:
        return {"outcome": self.outcome, "reason": self.reason, "lost": list(self.lost),
                "finished": list(self.finished), "step": self.step}


class Stranding:
    """The leader's: which ranks the recovery in progress is replacing, and whether it is stranded.

    `replacing(dead)` as each generation replaces ranks; `recovered()` when a step completes in
    the new generation. `check(done)`: stranded once some rank outside those being replaced has
    finished. From then on `lost` only grows (`absorb`), and `ending(done)` decides once every
    rank is either finished or lost, or `wait_s` has passed since it was stranded.
    """

    def __init__(self, world: int, *, wait_s: float, run_dir: Path, clock: Callable[[], float] = time.monotonic):
        if wait_s <= 0:
            raise ValueError(f"Stranding wait_s must be > 0 seconds, got {wait_s!r}; e.g. collective_timeout_s")
        self.world, self.wait_s, self.run_dir, self._clock = world, wait_s, run_dir, clock
        self._replacing: dict[int, str] = {}  # rank -> fault, in the incident in progress
        self.lost: dict[int, str] | None = None  # set once stranded
        self._since = 0.0

    @property
    def stranded(self) -> bool:
        return self.lost is not None

    def replacing(self, dead: dict[int, dict]) -> None:
        self._replacing.update({r: str(f.get("fault", "?")) for r, f in dead.items()})

    def recovered(self) -> None:
        self._replacing.clear()

    def check(self, done: dict[int, dict], dead: dict[int, dict] | None = None) -> bool:
        """True if stranded (now or before): a rank not being replaced (nor in `dead`) has finished."""
        if self.lost is None:
            replacing = {**self._replacing, **{r: str(f.get("fault", "?")) for r, f in (dead or {}).items()}}
            if not any(r not in replacing for r in done):
                return False
            self.lost, self._since = {r: f for r, f in replacing.items() if r not in done}, self._clock()
        else:
            self.absorb(dead or {})
        return True

    def absorb(self, dead: dict[int, dict]) -> None:
        """Ranks lost while stranded: no generation replaces them either."""
        for r, f in dead.items():
            self.lost.setdefault(r, str(f.get("fault", "?")))

    def ending(self, done: dict[int, dict]) -> Ending | None:
        """The decision once every rank is finished or lost (None: still waiting, within `wait_s`)."""
        lost = {r: f for r, f in self.lost.items() if r not in done}
        waiting = [r for r in range(self.world) if r not in done and r not in lost]
        step = max((int(d.get("steps", 0)) for d in done.values()), default=0)
        finished = tuple(sorted(done))
        who = f"rank(s) {_ranks(lost)} lost ({', '.join(sorted(set(lost.values())))})" if lost else "no rank lost"
        if waiting:
            if self._clock() - self._since < self.wait_s:
                return None
            return Ending("fail", f"{who} after rank(s) {_ranks(finished)} finished step {step}, and rank(s) "
                          f"{_ranks(waiting)} neither finished nor failed within {self.wait_s:.0f} s; the final "
                          f"state is incomplete: {self._resume_hint()}", tuple(sorted(lost)), finished, step)
        if 0 in lost and not self._weights_written(done):
            return Ending("fail", f"{who} after rank(s) {_ranks(finished)} finished step {step}: no peer is left to "
                          f"recover it from, and rank 0 writes the final weights, which it did not; "
                          f"{self._resume_hint()}", tuple(sorted(lost)), finished, step)
        return Ending("finish", f"{who} after rank(s) {_ranks(finished)} finished step {step}: every rank completed "
                      "that step's collectives, so the final weights are the finished ranks' (written by rank 0); "
                      "the job is finished without them", tuple(sorted(lost)), finished, step)

    def _weights_written(self, done: dict[int, dict]) -> bool:
        """Rank 0 wrote the final weights before it was lost, and they are the finished ranks'."""
        path = self.run_dir / "weights.sha256"
        digests = {d.get("sha256") for d in done.values()}
        if not path.exists() or len(digests) != 1:
            return False
        return path.read_text().split()[0] == digests.pop()

    def _resume_hint(self) -> str:
        return (f"continue from the newest checkpoint with `unbroken run --resume {self.run_dir}` "
                "(or rerun the job if it keeps none)")


def _ranks(ranks) -> str:
    return ",".join(map(str, sorted(ranks))) or "-"


def stuck(sup, dead: dict[int, dict]) -> bool:
    """`sup` (the leader's Supervisor): True if its recovery is stranded (ranks lost after some rank
    finished the job). The first time, stop the new members that would wait for the finished ranks."""
    was = sup.stranding.stranded
    if not sup.stranding.check(sup._done_records(), dead):
        return False
    if not was:
        lost = sorted(sup.stranding.lost)
        sup.events.emit("warning", message=f"rank(s) {lost} lost after their peers finished the job: not replaced; "
                                           "ending the job on what is committed")
        sup.status = "finishing (peers done)"
        for c in sup.table.children.values():  # members of a generation that can never form
            rank = sup._rank_of(c.proc)
            if c.taken and c.poll() is None and rank in sup.stranding.lost:
                sup.killed.add(c.proc)
                sup.watch.replaced(c.proc)  # stopped on purpose: its silence is no hang
                sup.events.emit("process_killed", pid=c.pid, proc=c.proc, rank=rank,
                                why="its generation needs ranks that already finished")
                sup.table.kill(c)
    return True


def end(sup) -> bool:
    """True once the stranded job may finish; LaunchError (its one-line reason) when it cannot."""
    ending = sup.stranding.ending(sup._done_records())
    if ending is None:
        return False
    sup.events.emit("recovery_abandoned", gen=sup.gen.gen, **ending.event_fields())
    if sup.chain is not None and sup.attempt is not None:
        sup.events.emit("retry", **sup.chain.record(sup.attempt, "failed", abandoned=ending.outcome))
        sup.chain = sup.attempt = None
    if ending.outcome == "fail":
        raise LaunchError(ending.reason)
    return True
