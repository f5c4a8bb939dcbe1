"""The structured event log: one JSON-lines schema, one writer, one tolerant reader.

Every fault and every decision is written here *before* anything acts on it.
Many processes append to the same file; each line is one `os.write` on an
O_APPEND descriptor, which Linux keeps whole.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# The kinds we emit, with the fields each carries (documentation, checked in tests).
KINDS: dict[str, str] = {
    "run_start": "config, world_size, nodes",
    "run_end": "steps, wall_s, weights_sha256, ok",
    "process_started": "pid, role (worker|shadow), proc, cold",
    "process_exited": "pid, proc, returncode, signal",
    "step": "step, loss, step_s, wait_s (time inside collectives), tokens",
    "heartbeat_missed": "proc, last_seen_s, phase, step (evidence for a hang)",
    "fault_detected": "fault (crash|hang|exception|numerics|straggler|stall|health), proc, node, evidence, occurred_at (simulated logs)",
    "fault_classified": "fault, cls (operable|replace), action (in_place|exclude_node|tier2|none), reason, proc, node, exclude, false_positive (optional)",
    "fault_injected": "fault, phase, step",
    "process_killed": "pid, proc, why",
    "generation": "gen, members, replaced, cause",
    "shadow_assigned": "proc, rank, gen, cold, shadow (warm|cold: was it ready when assigned)",
    "recovery_phase": "phase (detect|decide|regroup|rebuild|redo), start, end, step",
    "recovered": "step, steps_lost, steps_redone, recovery_s, breakdown, path (tier1|replica|tier2|local|initial)",
    "numerics": "step, what, action",
    "checkpoint_saved": "step, path, bytes, save_s",
    "checkpoint_invalid": "path, error",
    "parity_built": "bytes, seconds",
    "overlap_plan": "step, mode, source (on|off|file|cache|tuned|agreed|default until tuned), bucket_kb, first_bucket_kb, eager_update, during_backward, partition, compute_cores, comm_cores, compute_threads, reason",
    "overlap_tuned": "step, chosen, reason, candidates (bucket_kb, partition, step_s: the ranks' mean), search_s",
    "overlap_timeline": "step, backward_s, eager_chunks (of chunks: updated as their buckets landed), chunks, end_s, buckets ([issued, seen done] per bucket, s from the start of backward; rank 0, one step)",
    "protect_every_chosen": "step, protect_every, parity_extra_s, step_s, replay_step_s, mtbf_s, max_k",
    "retry": "attempt, of, action, outcome",
    "node_excluded": "node, faults, window_s",
    "straggler": "rank, ratio, median_s",
    "host": "load, mem_available_gb, disk_free_gb",
    "warning": "message",
    "collective_error": "step, phase, error (a worker saw its group fail)",
    "worker_done": "steps, weights_sha256, peak_rss_bytes, tensor_bytes, protection_bytes (by part)",
    "node_fenced": "node, lease_age_s, fence_after_s (this node could not renew its lease: it stopped its processes and writes nothing more)",
    "events_missing": "nodes, timeout_s (followers whose events did not reach node 0 at the end: the summary lacks them)",
    "tier2_restore": "step, reason",
    "node_lost": "node, lease_age_s, ranks (a node's lease expired: its supervisor and processes are gone or frozen)",
    "leader_elected": "node, previous, lease_age_s (replicated store: the previous leader's lease expired and this node took the role over by compare_set)",
    "software_fault": "proc, step, error, fingerprint, occurrences (the same exception at the same step again: not retried)",
    "steps_planned": "steps, source (config: --steps or the config file; script: trainer.steps(n))",
    "nondeterministic_input": "step, ranks, first, again, message (a step computed again gave a different loss on these ranks)",
    "job_stopped": "proc, reason, step (a worker declared that the job cannot go on: a gradient that stays non-finite, state no tier can restore)",
    "shadow_pool": "node, size, reason (the per-node standby pool was resized)",
    "node_joined": "node, attempt, failures (node 0 admitted a node that proved it knows the join token)",
    "join_refused": "node, attempt, failures, retry_after_s, why (a join attempt with a wrong token; the next is delayed)",
    "rl_pools": "method, rollout, train, staleness, processes (an RL run's pools at its start)",
    "rl_move": "proc, from_pool, to_pool, step, reason, rollout, train, train_gen (the controller moved a process between the RL pools)",
    "rl_lend": "proc, step, from_pool, to_pool, queued (dynamic: an idle trainer generates a queued group of the step training waits for)",
    "rl_help": "proc, step, share, samples, from_pool, to_pool, train_gen (dynamic: a rollout worker with nothing to generate computes a share of the step's gradient for training rank 0)",
    "rl_state_from": "proc, step, why (training rank 0 was lost after an update, or before its weights came: the newest weights come from this rank)",
    "rl_help_lost": "proc, step, share, why, rollout, train (a helper was lost with its share: training rank 0 computes it)",
    "rl_step": "step, reward, samples, tokens, rollout, train, train_gen, max_staleness, wall_s (an RL training step completed)",
    "rl_requeue": "proc, step, prompts, why, rollout, train (a lost rollout worker's in-flight prompts went back to the queue)",
    "rl_redo": "step, proc, why, rollout, train (a lost trainer rank: the step is redone by the survivors in a new training generation)",
    "link_congestion": "link (up|down:rank), congested, seq, rate_Bps, reference_Bps (comm/adaptive.py slow_links: a link's estimate crossed its threshold of the fleet's rate)",
    "collective_plan": "seq, plan, previous, predicted_s, congested, contended, bytes, by_time when the duel of ring and exchange decided it (comm/adaptive.py: the pattern of all-reduces of that size from collective seq on)",
    "recovery_abandoned": "gen, outcome (finish|fail), reason, lost, finished, step (ranks lost after their peers finished the job: no generation can form; runtime/stranded.py)",
    "nonfinite": "step, tensor, attempts, action (skip|stop: non-finite gradients persisted past the retry bound)",
}


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl."""

    time: float
    kind: str
    rank: int | None = None
    gen: int = 0
    node: int | None = None
    source: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {"time": self.time, "kind": self.kind, "rank": self.rank, "gen": self.gen,
             "node": self.node, "source": self.source, "fields": self.fields},
            separators=(",", ":"), default=str,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Event":
        if not isinstance(d.get("kind"), str) or not isinstance(d.get("time"), (int, float)):
            raise ValueError("an event needs a numeric 'time' and a string 'kind'")
        return Event(time=float(d["time"]), kind=d["kind"], rank=d.get("rank"),
                     gen=int(d.get("gen") or 0), node=d.get("node"),
                     source=str(d.get("source") or ""), fields=dict(d.get("fields") or {}))


class EventLog:
    """Appends events to a JSONL file; safe to share between processes."""

    def __init__(self, path: str | os.PathLike, *, source: str, rank: int | None = None,
                 node: int | None = None, gen: int = 0) -> None:
        self.path = Path(path)
        self.source, self.rank, self.node, self.gen = source, rank, node, gen
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.sealed = False

    def emit(self, kind: str, *, rank: int | None = None, **fields: Any) -> Event:
        assert kind in KINDS, f"unknown event kind {kind!r}; add it to events.KINDS"
        ev = Event(time=time.time(), kind=kind, rank=self.rank if rank is None else rank,
                   gen=self.gen, node=self.node, source=self.source, fields=fields)
        if not self.sealed:
            os.write(self._fd, (ev.to_json() + "\n").encode())
        return ev

    def seal(self) -> None:
        """Write nothing more (a fenced node: runtime/fence.py); later emits are dropped."""
        self.sealed = True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def node_events_path(run_dir: Path, node: int) -> Path:
    """Where node 0's run directory keeps another node's events (runtime/handover.py)."""
    return run_dir / f"events-node{node}.jsonl"


def run_dir_event_files(run_dir: Path) -> list[Path]:
    """A run directory's own events file, then the other nodes' handed over at the end."""
    return [run_dir / "events.jsonl", *sorted(run_dir.glob("events-node*.jsonl"))]


def read_events(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> list[Event]:
    """Read one or many events files (or run directories: every node's files), sorted by time.

    A broken line (a job killed mid-write) is skipped with a warning naming it.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [f for p in map(Path, paths) for f in (run_dir_event_files(p) if p.is_dir() else [p])]
    events: list[Event] = []
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    events.append(Event.from_dict(json.loads(line)))
                except (ValueError, TypeError, AttributeError) as e:
                    warnings.warn(f"{p}:{lineno}: skipped a malformed event line ({e})", stacklevel=2)
    events.sort(key=lambda e: e.time)
    return events
