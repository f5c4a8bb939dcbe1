"""How often the leader may recover: a rate limit over a sliding hour.

A multi-day job must survive any number of failures spread over its life, but not a
failure loop that recovers forever. The per-incident bound is the retry chain's budget
(`detect.retry`: attempts until a step completes); this module bounds the rate: at most
`per_hour` recoveries in any window of `window_s` seconds (0 = no limit).
"""
from __future__ import annotations

from collections import deque


class RecoveryRateExceeded(RuntimeError):
    """More recoveries within the window than the configured rate allows."""


class RecoveryRateLimit:
    def __init__(self, per_hour: int, *, window_s: float = 3600.0) -> None:
        if per_hour < 0 or window_s <= 0:
            raise ValueError(f"per_hour must be >= 0 and window_s > 0, got {per_hour}, {window_s}")
        self.per_hour, self.window_s = per_hour, window_s
        self._times: deque[float] = deque()

    def in_window(self, now: float) -> int:
        """Recoveries admitted within the last window_s seconds."""
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def admit(self, now: float) -> None:
        """Count one recovery at `now`; RecoveryRateExceeded if it is one too many."""
        if self.per_hour and self.in_window(now) >= self.per_hour:
            raise RecoveryRateExceeded(
                f"{self.in_window(now) + 1} recoveries within {self.window_s / 3600:g} h exceed "
                f"max_recoveries_per_hour={self.per_hour}: the job keeps failing; find the cause in the report, "
                "or raise the limit with --max-recoveries-per-hour")
        self._times.append(now)
