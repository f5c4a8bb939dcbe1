"""A follower node fences itself when it cannot renew its lease: it stops before node 0 replaces it.

Node 0 declares a node lost when its lease counter has not moved for `node_lease_s`
(runtime/lease.py), measured on node 0's clock from the moment node 0 saw it move, which is
never before the follower's own last successful renewal. So a follower that kills all its
processes once `fence_after_s` (< node_lease_s) has passed since its last successful renewal
has stopped before its ranks are handed to others: a partitioned node never trains or
writes alongside its replacements. The watch is a thread of its own because the loop that
renews may itself be stuck in a store call on the dead link.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

FENCE_FRACTION = 0.8  # fence after this share of node 0's lease: the margin covers a renewal in flight


class LeaseFence:
    def __init__(self, fence_after_s: float, on_fence: Callable[[float], None], *, clock=time.monotonic,
                 poll_s: float = 0.05) -> None:
        if fence_after_s <= 0:
            raise ValueError(f"fence_after_s must be > 0, got {fence_after_s!r}")
        self.fence_after_s, self._on_fence, self._clock, self._poll_s = fence_after_s, on_fence, clock, poll_s
        self._last_ok = clock()
        self._stop = threading.Event()
        self.fenced_age_s: float | None = None
        self._thread: threading.Thread | None = None

    def renewed(self) -> None:
        """The loop's lease renewal just succeeded."""
        self._last_ok = self._clock()

    def age_s(self) -> float:
        return self._clock() - self._last_ok

    def check(self) -> bool:
        """Fence now if the lease is too old (once); True when fenced."""
        if self.fenced_age_s is None and (age := self.age_s()) > self.fence_after_s:
            self.fenced_age_s = age
            self._on_fence(age)
        return self.fenced_age_s is not None

    def start(self) -> "LeaseFence":
        self._last_ok = self._clock()
        self._thread = threading.Thread(target=self._run, name="lease-fence", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.check():
                return
