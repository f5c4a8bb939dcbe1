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
chunk `chunk`, parameters updated but not yet the Adam moments), parity (delta of window
`chunk`), allgather, checkpoint, recovery (a survivor, during a recovery), shadow (the
shadow chosen for `rank`, right after assignment; its step is always 1: it has no state yet), build (initial parity build).
Each spec fires at most once per job: the store's atomic counter decides who fires.
"""
from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass

KINDS = ("sigkill", "sigstop", "exception", "nan", "bitflip", "slow", "linkdrop", "collerr", "nodekill",
         "nodestop")
NODE_KINDS = ("nodekill", "nodestop")  # faults of the rank's whole node, not of the rank
PHASES = ("forward", "backward", "allreduce", "reduced", "optimizer", "midchunk", "parity", "allgather",
          "checkpoint", "recovery", "shadow", "build")


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
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "nodestop":
            _freeze_node()


def _freeze_node() -> None:
    """SIGSTOP this rank's supervisor first (so it cannot react), then every process it
    started (workers, shadows), this one last."""
    sup = os.getppid()
    os.kill(sup, signal.SIGSTOP)
    for pid in _children(sup):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), signal.SIGSTOP)


def _children(parent: int) -> list[int]:
    """Direct children of `parent` (Linux /proc; the supervisor's are all direct)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == parent:  # field 4: ppid (after "comm")
            out.append(int(name))
    return out
