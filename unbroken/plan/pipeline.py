"""Two resources, one queue each: when does a step's last task end, given what waits for what.

A task runs on "compute" or "comm"; each resource runs its tasks one at a time in the order
they were added (a CPU thread computes in program order; a process group runs its
collectives in issue order). A task starts when its resource is free and every task it
depends on has ended. That is all the overlap model a strategy needs: DDP's buckets wait
for backward's gradients, ZeRO-3's layer waits for its all-gather, and so on.
"""
from __future__ import annotations

import dataclasses

RESOURCES = ("compute", "comm")


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    resource: str
    seconds: float
    after: tuple[int, ...] = ()  # indices of earlier tasks


class Pipeline:
    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, name: str, resource: str, seconds: float, after: tuple[int, ...] | list[int] = ()) -> int:
        """Add a task; returns its index (for `after` of later tasks)."""
        if resource not in RESOURCES:
            raise ValueError(f"resource must be one of {RESOURCES}, got {resource!r}")
        if not seconds >= 0:
            raise ValueError(f"task {name!r}: seconds must be >= 0, got {seconds!r}")
        after = tuple(after)
        if any(not 0 <= i < len(self.tasks) for i in after):
            raise ValueError(f"task {name!r} depends on a task not added yet: {after}")
        self.tasks.append(Task(name, resource, float(seconds), after))
        return len(self.tasks) - 1

    def schedule(self) -> list[tuple[float, float]]:
        """(start, end) of every task."""
        free = {r: 0.0 for r in RESOURCES}
        times: list[tuple[float, float]] = []
        for t in self.tasks:
            start = max([free[t.resource], *(times[i][1] for i in t.after)])
            times.append((start, start + t.seconds))
            free[t.resource] = start + t.seconds
        return times

    def makespan(self) -> float:
        return max((end for _, end in self.schedule()), default=0.0)

    def busy(self, resource: str) -> float:
        return sum(t.seconds for t in self.tasks if t.resource == resource)
