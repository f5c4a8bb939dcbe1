"""Fault injection at named phases: `sigkill:rank=2,step=30,phase=optimizer,chunk=1`.

Kinds: sigkill (crash), sigstop (hang), exception (Python error), nan (poisoned gradient),
bitflip (silent corruption of this rank's tier-1 parity chunk `chunk`), slow (from this
step on the rank spends `ms` extra milliseconds per step: a straggler), linkdrop (every
gloo connection of this rank is shut down, the process lives on: a broken link), collerr
(this rank alone sees its collective fail after its peers completed it: at phase `reduced`,
the rank discards the averaged gradient it just received and raises CollectiveError),
nodekill (the rank's whole node vanishes: its supervisor is SIGKILLed, and with it, by
PR_SET_PDEATHSIG, every worker and shadow there), nodestop (the whole node freezes: its
supervisor and every process it started are SIGSTOPped). Both need a rank on node >= 1:
node 0 hosts the store.
Phases: forward, backward, allreduce, reduced (the gradient all-reduce just completed), optimizer (before chunk `chunk`), midchunk (inside
chunk `chunk`: its first half updated, parameters and optimizer state, the second not yet), parity (delta of window
`chunk`), allgather, checkpoint, recovery (a survivor, during a recovery), shadow (the
shadow chosen for `rank`, right after assignment; its step is always 1: it has no state yet), build (initial parity build),
done (the rank finished its last step, the job's last collective is behind it: before it writes its final weights and
done record; its step is the last step).
Each spec fires at most once per job: the store's atomic counter decides who fires.

`check_reachable` refuses at start a spec that can never fire (worker.py's `_point` call
sites: which phases pass a chunk, which step each phase runs at); `unreachable_chunks` does
the same once the state layout is known; `faults_not_fired` names, after the run, the specs
that could have fired but did not (no `fault_injected` event accounts for them).
"""
from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

KINDS = ("sigkill", "sigstop", "exception", "nan", "bitflip", "slow", "linkdrop", "collerr", "nodekill",
         "nodestop")
NODE_KINDS = ("nodekill", "nodestop")  # faults of the rank's whole node, not of the rank
SUPERVISOR_ENV = "UNBROKEN_SUPERVISOR_PID"  # the node's supervisor, for nodekill and nodestop
PHASES = ("forward", "backward", "allreduce", "reduced", "optimizer", "midchunk", "parity", "allgather",
          "checkpoint", "recovery", "shadow", "build", "done")
CHUNK_PHASES = ("optimizer", "midchunk", "parity")  # the points that pass a chunk (parity: a window) index
STEP_ONE_PHASES = ("build", "shadow")  # point(phase) at step_count + 1 of a process with no step done yet


class InjectedFault(RuntimeError):
    """Raised by an `exception` fault: an ordinary Python error in the training code."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    step: int
    phase: str = "backward"
    chunk: int = 0
    ms: int = 0  # `slow` only: extra milliseconds per step

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown fault phase {self.phase!r}; use one of {', '.join(PHASES)}")
        if self.rank < 0 or self.step < 0 or self.chunk < 0 or self.ms < 0:
            raise ValueError(f"fault rank, step and chunk must be >= 0, got {self}")

    @staticmethod
    def parse(text: str) -> "FaultSpec":
        """'sigkill:rank=2,step=30,phase=backward' -> FaultSpec."""
        kind, _, rest = text.strip().partition(":")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, val = part.partition("=")
            if not eq:
                raise ValueError(f"bad fault field {part!r} in {text!r}; expected key=value")
            fields[key.strip()] = val.strip()
        unknown = set(fields) - {"rank", "step", "phase", "chunk", "ms"}
        if unknown:
            raise ValueError(f"unknown fault field {sorted(unknown)[0]!r} in {text!r}; "
                             "allowed: rank, step, phase, chunk, ms")
        try:
            return FaultSpec(kind=kind.strip(), rank=int(fields.get("rank", 0)), step=int(fields.get("step", 1)),
                             phase=fields.get("phase", "backward"), chunk=int(fields.get("chunk", 0)),
                             ms=int(fields.get("ms", 0)))
        except ValueError as e:
            raise ValueError(f"bad fault spec {text!r}: {e}") from None

    def __str__(self) -> str:
        extra = f",ms={self.ms}" if self.ms else ""
        return f"{self.kind}:rank={self.rank},step={self.step},phase={self.phase},chunk={self.chunk}{extra}"


def chaos_schedule(text: str, *, world: int, steps: int) -> list[FaultSpec]:
    """'seed=1,rate=0.05' -> a reproducible list of sigkills (rate = kills per step)."""
    opts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    unknown = set(opts) - {"seed", "rate", "kinds"}
    if unknown:
        raise ValueError(f"unknown chaos option {sorted(unknown)[0]!r}; allowed: seed, rate, kinds")
    rng = random.Random(int(opts.get("seed", 0)))
    rate = float(opts.get("rate", 0.02))
    if not 0 <= rate <= 1:
        raise ValueError(f"chaos rate must be within 0..1 kills per step, got {rate}")
    kinds = opts.get("kinds", "sigkill").split("+")
    specs, last = [], 0
    for step in range(2, steps):
        if rng.random() < rate and step - last >= 3:  # space kills so each recovery completes
            specs.append(FaultSpec(kind=rng.choice(kinds), rank=rng.randrange(world), step=step,
                                   phase=rng.choice(["forward", "backward", "allreduce", "optimizer", "allgather"])))
            last = step
    return specs


def check_reachable(specs: Iterable[FaultSpec], *, world_size: int, steps: int | None, tier1: bool = True,
                    checkpoint_every: int | None = None) -> None:
    """Refuse a spec that can never fire: ValueError naming it, why, and the fix.

    steps: the run's step count when known up front (None: the script decides); tier1: the
    run keeps tier-1 parity; checkpoint_every: tier-2's period (0 = off; None: unknown).
    """
    for s in specs:
        why = _never_here(s, world_size, tier1, checkpoint_every) or _never_then(s, steps)
        if why:
            raise ValueError(f"fault {s} can never fire: {why}")


def _never_here(s: FaultSpec, world_size: int, tier1: bool, checkpoint_every: int | None) -> str | None:
    """Why no rank, chunk or point of this run matches `s` (None: some may)."""
    if s.rank >= world_size:
        return f"it names rank {s.rank} but the world has {world_size} ranks; use rank=0..{world_size - 1}"
    if s.chunk and s.phase not in CHUNK_PHASES:  # every other point passes chunk 0 (bitflip included)
        fix = (f"use phase=parity,chunk={s.chunk} to corrupt parity window {s.chunk}" if s.kind == "bitflip"
               else f"drop chunk={s.chunk}, or use phase=optimizer or midchunk")
        return f"phase {s.phase} has no chunks (only {', '.join(CHUNK_PHASES)} do); {fix}"
    if not tier1 and (s.phase == "parity" or s.kind == "bitflip"):
        return ("this run keeps no tier-1 parity to update or corrupt; use --strategy zero1, zero2, zero3 or fsdp with "
                "--parity-group 2 or more, or another phase/kind")
    if s.phase == "checkpoint" and checkpoint_every is not None:
        if checkpoint_every <= 0:
            return "tier-2 checkpoints are off (--checkpoint-every 0); set --checkpoint-every K or pick another phase"
        if s.step % checkpoint_every:
            return (f"checkpoints are written every {checkpoint_every} steps; use a step that is a multiple of "
                    f"{checkpoint_every}")
    return None


def _never_then(s: FaultSpec, steps: int | None) -> str | None:
    """Why no step of this run matches `s` (None: one may)."""
    if s.step == 0 and s.phase != "checkpoint":
        return "steps start at 1 (only phase checkpoint has a step 0: the initial checkpoint); use step=1 or later"
    if s.phase in STEP_ONE_PHASES and s.step != 1:
        when = "once, before the first step" if s.phase == "build" else "as it takes over, before it has any state"
        return f"phase {s.phase} runs {when}: its step is always 1; use step=1"
    if s.phase == "done" and steps is not None and s.step != steps:
        return f"phase done runs once, after the last step ({steps}); use step={steps}"
    limit = None if steps is None else steps + 1 if s.phase == "recovery" else steps  # recovering after step N: N+1
    if limit is not None and s.step > limit:
        return f"the run has {steps} steps; use step={1 if s.phase != 'checkpoint' else 0}..{limit} or raise --steps"
    return None


def unreachable_chunks(specs: Iterable[FaultSpec], *, n_chunks: int, n_windows: int) -> list[str]:
    """One message per spec whose chunk index is past the last chunk of this run's layout.

    optimizer/midchunk: chunk >= n_chunks (chunks per rank); parity, and bitflip at any other
    phase: chunk >= n_windows (parity windows per rank) when the run keeps parity (n_windows > 0).
    """
    out = []
    for s in specs:
        if s.phase in ("optimizer", "midchunk"):
            limit, what = n_chunks, "chunks"
        elif (s.phase == "parity" or s.kind == "bitflip") and n_windows > 0:
            limit, what = n_windows, "parity windows"
        else:
            continue
        if s.chunk >= limit:
            out.append(f"fault {s} can never fire: chunk {s.chunk} is past the last of the {limit} {what} each "
                       f"rank has; use chunk=0..{limit - 1}")
    return out


def faults_not_fired(specs: Iterable[FaultSpec], events: Iterable[Mapping[str, Any]]) -> list[FaultSpec]:
    """The specs that no `fault_injected` event shows firing, in order; each event accounts for one.

    events: events.jsonl records as dicts ({"kind", "rank", "node", "fields": {fault, phase, step,
    chunk}}). A node fault's event from node 0 is no firing: `FaultInjector.fire` skips it there
    (a shadow on node 0 holds the rank now) and its claim is spent. An event without a rank or
    chunk (an older log) matches any, after the exact matches are taken.
    """
    pending = list(specs)
    fired = [e for e in events if e.get("kind") == "fault_injected" and not _skipped_on_node_0(e)]
    for exact in (True, False):
        for e in list(fired):
            i = next((i for i, s in enumerate(pending) if _fired_as(s, e, exact=exact)), None)
            if i is not None:
                del pending[i]
                fired.remove(e)
    return pending


def _skipped_on_node_0(e: Mapping[str, Any]) -> bool:
    return (e.get("fields") or {}).get("fault") in NODE_KINDS and e.get("node") == 0


def _fired_as(s: FaultSpec, e: Mapping[str, Any], *, exact: bool) -> bool:
    f = e.get("fields") or {}
    rank = e.get("rank") if e.get("rank") is not None else f.get("rank")
    chunk = f.get("chunk")
    if (f.get("fault"), f.get("phase"), f.get("step")) != (s.kind, s.phase, s.step):
        return False
    if exact:
        return rank == s.rank and chunk == s.chunk
    return rank in (None, s.rank) and chunk in (None, s.chunk)


class FaultInjector:
    """Called at every named point; fires a matching spec once per job."""

    def __init__(self, specs: list[FaultSpec], claim) -> None:
        self.specs = list(specs)
        self._claim = claim  # claim(index) -> True for exactly one caller per spec

    def due(self, phase: str, *, rank: int, step: int, chunk: int = 0) -> FaultSpec | None:
        for i, s in enumerate(self.specs):
            if s.phase == phase and s.rank == rank and s.step == step and s.chunk == chunk and self._claim(i):
                return s
        return None

    @staticmethod
    def fire(spec: FaultSpec) -> None:
        """Carry out a process-level fault (the caller handles `nan`)."""
        if spec.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "exception":
            raise InjectedFault(f"injected exception at {spec}")
        elif spec.kind in NODE_KINDS and os.environ.get("NODE_RANK", "0") == "0":
            return  # the rank now lives on node 0 (a shadow there took it over): never the store's host
        elif spec.kind == "nodekill":  # the supervisor's children die with it (PR_SET_PDEATHSIG)
            os.kill(supervisor_pid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "nodestop":
            _freeze_node()


def supervisor_pid() -> int:
    """This node's supervisor: named in the environment it gave us (our parent is its fork
    server when it has one, runtime/zygote.py), else our parent (a child started the exec way)."""
    return int(os.environ.get(SUPERVISOR_ENV) or os.getppid())


def _freeze_node() -> None:
    """SIGSTOP this rank's supervisor first (so it cannot react), then every process it
    started (its fork server, workers, shadows), this one last."""
    sup = supervisor_pid()
    os.kill(sup, signal.SIGSTOP)
    for pid in _descendants(sup):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), signal.SIGSTOP)


def _descendants(root: int) -> list[int]:
    """Every process below `root`, parents before their children (Linux /proc ppid links)."""
    parent_of = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent_of[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])  # field 4: ppid (after "comm")
    out, frontier = [], [root]
    while frontier:
        kids = sorted(pid for pid, ppid in parent_of.items() if ppid in frontier)
        out += kids
        frontier = kids
    return out
