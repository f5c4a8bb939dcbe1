"""The automatic retry chain: attempts with exponential backoff, a budget, and escalation.

Each link (attempt + outcome) becomes the fields of one `retry` event, so the report
can show every chain and whether it ended well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from unbroken.detect.classify import ACTIONS

OUTCOMES = ("ok", "failed")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """`budget` attempts at most. Attempt 1 starts at once; attempt k >= 2 waits
    min(max_backoff_s, base_backoff_s x factor^(k-2)). After `escalate_after` failed
    attempts the remaining ones use `fallback` (restore from the persistent tier)."""

    budget: int = 3
    base_backoff_s: float = 0.5
    factor: float = 2.0
    max_backoff_s: float = 30.0
    escalate_after: int = 2
    fallback: str = "tier2"

    def __post_init__(self) -> None:
        if not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"RetryPolicy.budget must be an integer >= 1, got {self.budget!r}; e.g. 3")
        for name in ("base_backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"RetryPolicy.{name} must be a finite number of seconds >= 0, got {v!r}")
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"RetryPolicy.factor must be >= 1 (backoff never shrinks), got {self.factor!r}; e.g. 2")
        if not (isinstance(self.escalate_after, int) and self.escalate_after >= 1):
            raise ValueError(f"RetryPolicy.escalate_after must be an integer >= 1, got {self.escalate_after!r}")
        if self.fallback not in ACTIONS:
            raise ValueError(f"RetryPolicy.fallback must be one of {', '.join(ACTIONS)}, got {self.fallback!r}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before `attempt` (1-based)."""
        assert attempt >= 1, attempt
        if attempt == 1:
            return 0.0
        return min(self.max_backoff_s, self.base_backoff_s * self.factor ** (attempt - 2))


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One link of the chain: try `action` after waiting `backoff_s`."""

    attempt: int
    of: int
    action: str
    backoff_s: float


class RetryChain:
    """Drive recovery attempts for one fault until one succeeds or the budget is spent.

        chain = RetryChain(policy, action=decision.action, fault=decision.fault)
        for a in chain:
            time.sleep(a.backoff_s)
            log.emit("retry", **chain.record(a, "ok" if try_recover(a.action) else "failed"))
    """

    def __init__(self, policy: RetryPolicy | None = None, *, action: str, fault: str = "") -> None:
        if action not in ACTIONS:
            raise ValueError(f"RetryChain action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.policy = policy or RetryPolicy()
        self.action, self.fault = action, fault
        self.links: list[dict[str, Any]] = []
        self._issued = 0

    @property
    def succeeded(self) -> bool:
        return bool(self.links) and self.links[-1]["outcome"] == "ok"

    @property
    def done(self) -> bool:
        return self.succeeded or len(self.links) >= self.policy.budget

    def next_attempt(self) -> Attempt | None:
        """The next attempt, or None when the chain has succeeded or spent its budget."""
        assert self._issued == len(self.links), "record the outcome of the previous attempt first"
        if self.done:
            return None
        self._issued += 1
        k = self._issued
        failed = len(self.links)
        action = self.policy.fallback if failed >= self.policy.escalate_after else self.action
        return Attempt(attempt=k, of=self.policy.budget, action=action, backoff_s=self.policy.backoff(k))

    def __iter__(self) -> Iterator[Attempt]:
        while (a := self.next_attempt()) is not None:
            yield a

    def record(self, attempt: Attempt, outcome: str, **detail: Any) -> dict[str, Any]:
        """Record `attempt`'s outcome ('ok' or 'failed'); return the `retry` event fields."""
        if outcome not in OUTCOMES:
            raise ValueError(f"retry outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        assert attempt.attempt == len(self.links) + 1 == self._issued, "outcomes must be recorded in order"
        link = {"attempt": attempt.attempt, "of": attempt.of, "action": attempt.action, "outcome": outcome,
                "backoff_s": attempt.backoff_s, "fault": self.fault,
                "final": outcome == "ok" or attempt.attempt >= attempt.of, **detail}
        self.links.append(link)
        return link
