"""Classification of findings into actions, and the per-node repeat-offender table.

Hardware-operable faults are recovered in place; replace faults (a repeat offender
node, a persistent straggler, a failed health probe) exclude the node.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from unbroken.detect.detectors import FAULTS, Finding

CLASSES = ("operable", "replace")
ACTIONS = ("in_place", "exclude_node", "tier2", "none")
# Faults that are a property of the node, not of one unlucky moment: replace on the first one.
ALWAYS_REPLACE = ("straggler", "health", "node_lost")


@dataclass(frozen=True, kw_only=True)
class ExclusionPolicy:
    """Exclude a node once it has `max_faults` faults within `window_s` seconds."""

    max_faults: int = 3
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_faults, int) and self.max_faults >= 1):
            raise ValueError(f"ExclusionPolicy.max_faults must be an integer >= 1, got {self.max_faults!r}; "
                             f"e.g. 3 (exclude on the 3rd fault within window_s)")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"ExclusionPolicy.window_s must be a finite number of seconds > 0, "
                             f"got {self.window_s!r}; e.g. 3600")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do about one finding, and why."""

    fault: str
    cls: str
    action: str
    reason: str
    proc: str = ""
    rank: int | None = None
    node: int | None = None
    exclude: bool = False   # the node is excluded (action exclude_node, or tier2 without it)

    def __post_init__(self) -> None:
        assert self.fault in FAULTS and self.cls in CLASSES and self.action in ACTIONS, self
        assert not self.exclude or (self.cls == "replace" and self.node is not None), self

    def event_fields(self) -> dict[str, Any]:
        """Fields of the `fault_classified` event (pass `rank=decision.rank` to `emit`)."""
        return {"fault": self.fault, "cls": self.cls, "action": self.action, "reason": self.reason,
                "proc": self.proc, "node": self.node, "exclude": self.exclude}


@dataclass
class _NodeRecord:
    times: deque[float] = field(default_factory=deque)   # fault times inside the window
    total: int = 0
    by_fault: dict[str, int] = field(default_factory=dict)
    excluded_at: float | None = None


class OffenderTable:
    """Faults per node over a sliding window; says when a node must be excluded.

    `record` is idempotent per finding (same fault, proc and time), so recording a
    finding twice never double-counts.
    """

    def __init__(self, policy: ExclusionPolicy | None = None) -> None:
        self.policy = policy or ExclusionPolicy()
        self._nodes: dict[int, _NodeRecord] = {}
        self._seen: set[tuple[str, str, float]] = set()

    def record(self, finding: Finding) -> int:
        """Count `finding` against its node; return the node's faults within the window (0 if no node)."""
        if finding.node is None:
            return 0
        rec = self._nodes.setdefault(finding.node, _NodeRecord())
        key = (finding.fault, finding.proc, finding.time)
        if key not in self._seen:
            self._seen.add(key)
            rec.times.append(finding.time)
            rec.total += 1
            rec.by_fault[finding.fault] = rec.by_fault.get(finding.fault, 0) + 1
        return self.count(finding.node, finding.time)

    def count(self, node: int, now: float) -> int:
        """Faults of `node` in (now - window_s, now]."""
        rec = self._nodes.get(node)
        if rec is None:
            return 0
        return sum(1 for t in rec.times if now - self.policy.window_s < t <= now)

    def must_exclude(self, node: int, now: float) -> bool:
        return self.count(node, now) >= self.policy.max_faults

    def exclude(self, node: int, now: float) -> dict[str, Any]:
        """Mark `node` excluded; return the fields of its `node_excluded` event."""
        rec = self._nodes.setdefault(node, _NodeRecord())
        if rec.excluded_at is None:
            rec.excluded_at = now
        return {"node": node, "faults": self.count(node, now), "window_s": self.policy.window_s}

    def is_excluded(self, node: int | None) -> bool:
        return node is not None and node in self._nodes and self._nodes[node].excluded_at is not None

    def rows(self, now: float) -> list[dict[str, Any]]:
        """One row per node, worst first: faults in window, total, by fault, excluded."""
        rows = [{"node": n, "in_window": self.count(n, now), "total": r.total, "by_fault": dict(r.by_fault),
                 "excluded": r.excluded_at is not None} for n, r in self._nodes.items()]
        return sorted(rows, key=lambda r: (-r["total"], r["node"]))


def classify(finding: Finding, offenders: OffenderTable, *, can_exclude: bool = True,
             tier1_ok: bool = True) -> Decision:
    """Record `finding` in `offenders` and decide the action.

    `can_exclude`: the job can continue without the finding's node (spare capacity or
    a smaller world is acceptable). `tier1_ok`: in-memory parity can rebuild what the
    lost ranks held; if not, the action becomes `tier2` (persistent checkpoint).
    """
    base = {"fault": finding.fault, "proc": finding.proc, "rank": finding.rank, "node": finding.node}
    if offenders.is_excluded(finding.node):
        return Decision(**base, cls="replace", action="none",
                        reason=f"node {finding.node} is already excluded")
    count = offenders.record(finding)
    pol = offenders.policy
    if finding.fault in ALWAYS_REPLACE:
        cls, reason = "replace", _replace_reason(finding)
    elif finding.node is not None and count >= pol.max_faults:
        cls, reason = "replace", (f"node {finding.node} had {count} faults within {pol.window_s:g} s "
                                  f"(policy: exclude at {pol.max_faults})")
    else:
        cls, reason = "operable", f"{finding.fault} is hardware-operable: recover in place"
    if cls == "operable":
        action = "in_place" if tier1_ok else "tier2"
    elif finding.node is None or not can_exclude:
        action = "in_place" if tier1_ok else "tier2"
        reason += "; the node cannot be excluded, so recovering without excluding it"
    else:
        action = "exclude_node" if tier1_ok else "tier2"
        offenders.exclude(finding.node, finding.time)
    if not tier1_ok:
        reason += "; tier-1 parity cannot rebuild the lost state, restoring from tier 2"
    return Decision(**base, cls=cls, action=action, reason=reason,
                    exclude=offenders.is_excluded(finding.node))


def _replace_reason(f: Finding) -> str:
    ev = f.evidence
    if f.fault == "node_lost":
        return f"node lost: {ev.get('why', 'its lease expired')}; its ranks are replaced on other nodes"
    if f.fault == "straggler":
        return (f"persistent straggler: {ev.get('ratio')}x the peers' median step time for "
                f"{ev.get('windows')} windows of {ev.get('window_steps')} steps")
    return f"health probe {ev.get('probe', '')} failed: {'; '.join(ev.get('problems', [])) or 'no detail'}"
