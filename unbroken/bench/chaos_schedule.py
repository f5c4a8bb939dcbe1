"""Random fault schedules for `unbroken chaos`: schedule i is a pure function of (seed, i).

Patterns: one fault; faults in adjacent steps (same rank or another); the same step on
two ranks; a fault on a survivor during the recovery from a first fault; a fault in the
shadow being started for a rank that just died; and, when the job spans several nodes, the
loss of a whole node (nodekill: its supervisor and every process there SIGKILLed; nodestop:
all of them frozen), never node 0 (the store's host). Kinds: sigkill, sigstop, exception
(lethal: the process is lost and replaced), nan and linkdrop (the process lives on).

Tier 1 rebuilds one lost member per parity group per incident (groups are consecutive
ranks on one node, strided across nodes so that a node loss costs each group one member:
`parallel.groups.ParityGroups`). Two lethal losses in one group in the same incident fall back
to a tier-2 checkpoint and may lose steps, so the patterns whose two faults belong to one
incident (same step, during recovery) put two lethal faults in different parity groups;
nan and linkdrop may land anywhere. Fault steps lie in 2..steps-1, except a shadow's: its
injection point counts from the shadow's own empty state (step 0 + 1 = `SHADOW_STEP`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from unbroken.parallel.groups import ParityGroups
from unbroken.runtime.faults import KINDS, NODE_KINDS, PHASES, FaultSpec

CHAOS_KINDS = ("sigkill", "sigstop", "exception", "nan", "linkdrop")
LETHAL = ("sigkill", "sigstop", "exception")
PATTERNS = ("single", "adjacent_same_rank", "adjacent_other_rank", "same_step", "during_recovery",
            "shadow_startup")
NODE_PATTERNS = ("node_loss",)  # added to the rotation when the job spans several nodes
# Points inside a training step. parity and checkpoint only exist on some steps (see _phases).
STEP_PHASES = ("forward", "backward", "allreduce", "reduced", "optimizer", "midchunk", "parity", "allgather",
               "checkpoint")
# Before the step's parameter all-gather: the step is not committed anywhere yet, so the
# survivors' recovery point is this same step (a fault at `checkpoint` comes after the commit).
PRE_COMMIT = ("forward", "backward", "allreduce", "reduced", "optimizer", "midchunk", "allgather")
# A fault that may follow a recovery: after one the next parity step may move, so no `parity`.
AFTER_FIRST = tuple(p for p in STEP_PHASES if p != "parity")
SHADOW_STEP = 1  # worker._serve_as_shadow: point("shadow") at step_count + 1 of a stateless shadow
# Chunks 0..2 exist on every rank: the chaos job's tiny GPT has ~20 chunks of 16 KiB per rank at
# world 4; the runner checks that every spec fired, which would catch a chunk out of range.
MAX_CHUNK = 3

assert set(CHAOS_KINDS) <= set(KINDS) and set(LETHAL) <= set(CHAOS_KINDS), "fault kinds renamed in faults.py"
assert set(STEP_PHASES) | {"recovery", "shadow"} <= set(PHASES), "fault phases renamed in faults.py"


@dataclass(frozen=True, kw_only=True)
class ChaosShape:
    """The job the schedules are drawn for."""

    world_size: int
    steps: int
    parity_group: int
    protect_every: int  # tier-1 parity steps: multiples of it (the `parity` phase exists only there)
    checkpoint_every: int  # tier-2 checkpoint steps: multiples of it (the `checkpoint` phase); 0 = off
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"chaos needs --world-size >= 2 (a fault needs a survivor), got {self.world_size}")
        if self.steps < 4:
            raise ValueError(f"chaos needs --steps >= 4 (two adjacent fault steps within 2..steps-1), got {self.steps}")
        group = min(self.parity_group, self.world_size)
        if self.parity_group < 2 or self.world_size % group:
            raise ValueError(f"--parity-group must be >= 2 and divide --world-size {self.world_size}, "
                             f"got {self.parity_group}")
        if self.nnodes < 1 or self.world_size % self.nnodes or self.world_size // self.nnodes < 1:
            raise ValueError(f"--nnodes must divide --world-size {self.world_size}, got {self.nnodes}")
        if self.protect_every < 1 or self.checkpoint_every < 0:
            raise ValueError(f"protect_every must be >= 1 and checkpoint_every >= 0, got "
                             f"{self.protect_every} and {self.checkpoint_every}")

    def group_of(self, rank: int) -> int:
        return ParityGroups(self.world_size, min(self.parity_group, self.world_size), self.nnodes).group_of(rank)

    def node_of(self, rank: int) -> int:
        return rank // (self.world_size // self.nnodes)

    @property
    def patterns(self) -> tuple[str, ...]:
        return PATTERNS + (NODE_PATTERNS if self.nnodes > 1 else ())


@dataclass(frozen=True)
class Schedule:
    index: int
    pattern: str
    faults: tuple[FaultSpec, ...]

    @property
    def specs(self) -> list[str]:
        return [str(f) for f in self.faults]


def schedules(seed: int, n: int, shape: ChaosShape) -> list[Schedule]:
    return [schedule(seed, i, shape) for i in range(n)]


def schedule(seed: int, index: int, shape: ChaosShape) -> Schedule:
    """Schedule `index` of `seed`. Patterns take turns (so any 6 consecutive schedules hold
    each once); everything else is drawn from an RNG seeded by (seed, index) alone."""
    pattern = shape.patterns[(seed + index) % len(shape.patterns)]
    rng = random.Random(f"unbroken-chaos:{seed}:{index}")
    return Schedule(index, pattern, _DRAW[pattern](rng, shape))


def _single(rng: random.Random, shape: ChaosShape) -> tuple[FaultSpec, ...]:
    return (_fault(rng, shape, rng.choice(CHAOS_KINDS), rng.randrange(shape.world_size), _step(rng, shape)),)


def _adjacent(rng: random.Random, shape: ChaosShape, *, same_rank: bool) -> tuple[FaultSpec, ...]:
    step = _step(rng, shape, last=shape.steps - 2)
    a = rng.randrange(shape.world_size)
    b = a if same_rank else rng.choice([r for r in range(shape.world_size) if r != a])
    return (_fault(rng, shape, rng.choice(CHAOS_KINDS), a, step),
            _fault(rng, shape, rng.choice(CHAOS_KINDS), b, step + 1, phases=AFTER_FIRST))


def _same_step(rng: random.Random, shape: ChaosShape) -> tuple[FaultSpec, ...]:
    step, kind, a = _step(rng, shape), rng.choice(CHAOS_KINDS), rng.randrange(shape.world_size)
    kind_b, b = _partner(rng, shape, kind, a)
    # either may fire first (and the step be redone): neither at `parity`
    return _fault(rng, shape, kind, a, step, phases=AFTER_FIRST), _fault(rng, shape, kind_b, b, step, phases=AFTER_FIRST)


def _during_recovery(rng: random.Random, shape: ChaosShape) -> tuple[FaultSpec, ...]:
    # the first fault must start a recovery (nan only redoes the step) before the step commits
    step, kind, a = _step(rng, shape), rng.choice([k for k in CHAOS_KINDS if k != "nan"]), rng.randrange(shape.world_size)
    kind_b, b = _partner(rng, shape, kind, a)
    return (_fault(rng, shape, kind, a, step, phases=PRE_COMMIT),
            FaultSpec(kind=kind_b, rank=b, step=step, phase="recovery"))


def _shadow_startup(rng: random.Random, shape: ChaosShape) -> tuple[FaultSpec, ...]:
    # the first fault must consume a shadow: a lethal one; the second hits that shadow
    step, a = _step(rng, shape), rng.randrange(shape.world_size)
    return (_fault(rng, shape, rng.choice(LETHAL), a, step),
            FaultSpec(kind=rng.choice(CHAOS_KINDS), rank=a, step=SHADOW_STEP, phase="shadow"))


def _node_loss(rng: random.Random, shape: ChaosShape) -> tuple[FaultSpec, ...]:
    # a rank on node >= 1 takes its node down; maybe a non-lethal fault on node 0 in the same step
    step = _step(rng, shape)
    rank = rng.choice([r for r in range(shape.world_size) if shape.node_of(r) > 0])
    out = (_fault(rng, shape, rng.choice(NODE_KINDS), rank, step, phases=AFTER_FIRST),)
    if rng.random() < 0.5:
        mates = [r for r in range(shape.world_size) if shape.node_of(r) == 0]
        out += (_fault(rng, shape, rng.choice(("nan", "linkdrop")), rng.choice(mates), step, phases=AFTER_FIRST),)
    return out


_DRAW = {
    "single": _single,
    "adjacent_same_rank": lambda rng, shape: _adjacent(rng, shape, same_rank=True),
    "adjacent_other_rank": lambda rng, shape: _adjacent(rng, shape, same_rank=False),
    "same_step": _same_step,
    "during_recovery": _during_recovery,
    "shadow_startup": _shadow_startup,
    "node_loss": _node_loss,
}
assert tuple(_DRAW) == PATTERNS + NODE_PATTERNS


def _partner(rng: random.Random, shape: ChaosShape, kind: str, rank: int) -> tuple[str, int]:
    """Kind and rank of a second fault in the same incident as (kind, rank): another rank,
    and never a second lethal loss in the first one's parity group."""
    others = [r for r in range(shape.world_size) if r != rank]
    elsewhere = [r for r in others if shape.group_of(r) != shape.group_of(rank)]
    kind_b = rng.choice(CHAOS_KINDS if elsewhere or kind not in LETHAL else ("nan", "linkdrop"))
    if kind in LETHAL and kind_b in LETHAL:
        return kind_b, rng.choice(elsewhere)
    return kind_b, rng.choice(others)


def _step(rng: random.Random, shape: ChaosShape, *, last: int | None = None) -> int:
    return rng.randint(2, shape.steps - 1 if last is None else last)


def _phases(shape: ChaosShape, step: int, allowed: tuple[str, ...]) -> list[str]:
    """The phases of `allowed` that step `step` passes through: parity only on the first
    parity step (after a recovery the next one may move), checkpoint only on checkpoint steps."""
    out = [p for p in allowed if p not in ("parity", "checkpoint")]
    if "parity" in allowed and step == shape.protect_every:
        out.append("parity")
    if "checkpoint" in allowed and shape.checkpoint_every and step % shape.checkpoint_every == 0:
        out.append("checkpoint")
    return out


def _fault(rng: random.Random, shape: ChaosShape, kind: str, rank: int, step: int, *,
           phases: tuple[str, ...] = STEP_PHASES) -> FaultSpec:
    phase = rng.choice(_phases(shape, step, phases))
    chunk = rng.randrange(MAX_CHUNK) if phase in ("optimizer", "midchunk") else 0
    return FaultSpec(kind=kind, rank=rank, step=step, phase=phase, chunk=chunk)
