"""The bounded adapter cache: which adapter sits in which slot, least-recently-used eviction of
slots no running request pins, and counts of hits, loads and evictions."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class AdapterCache:
    """`slots` resident adapters; `load(name, slot)` fills a slot (from disk). A slot in use by a
    running request is pinned and never evicted: such a request's neighbours wait instead."""

    def __init__(self, slots: int, load: Callable[[str, int], None]) -> None:
        self.slots = slots
        self._load = load
        self._where: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._pins = [0] * (slots + 1)
        self.hits = self.loads = self.evictions = 0

    def resident(self) -> list[str]:
        return list(self._where)

    def can_acquire(self, name: str) -> bool:
        return name in self._where or len(self._where) < self.slots or self._victim() is not None

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` (loading it, evicting the LRU unpinned one), pinned; None when every
        slot is pinned by other adapters."""
        slot = self._where.get(name)
        if slot is not None:
            self.hits += 1
            self._where.move_to_end(name)
        else:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load(name, slot)
            self.loads += 1
            self._where[name] = slot
        self._pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        assert self._pins[slot] > 0, f"slot {slot} released more often than acquired"
        self._pins[slot] -= 1

    def _victim(self) -> str | None:
        return next((n for n, s in self._where.items() if self._pins[s] == 0), None)

    def _free_slot(self) -> int | None:
        used = set(self._where.values())
        free = next((s for s in range(1, self.slots + 1) if s not in used), None)
        if free is not None:
            return free
        victim = self._victim()
        if victim is None:
            return None
        self.evictions += 1
        return self._where.pop(victim)
