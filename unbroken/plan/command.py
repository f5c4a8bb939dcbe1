"""`unbroken plan`: predicted step time and memory per strategy on a measured topology, and the choice.

    unbroken plan --model small --world-size 4 [--memory-limit GB] [--topology FILE]
                  [--measure-topology FILE] [--batch-size 8] [--profile FILE] [--json]

Without --topology the wiring is measured here, on loopback (all ranks on this host). The
model's profile is measured once and cached (--profile, default under ~/.cache/unbroken).
`choose_for_run` is what `unbroken run --strategy auto` asks (strategies unbroken runs only).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from unbroken.cli_error import fail
from unbroken.config import ConfigError, RunConfig
from unbroken.plan import cost, profile as profiles, ranks
from unbroken.protect.interval import memory_budget_bytes
from unbroken.plan.topology import Topology, TopologyError

# What `--strategy auto` may pick: the strategies whose unbroken schedule the cost model
# describes. Its zero2 is FSDP2's (per-unit gathers, reduce-scatter overlapped with backward);
# unbroken's zero2 keeps whole parameters and reduce-scatters once after backward, so the
# planner does not choose it until the model has that schedule. unbroken's zero3 gathers per
# unit as the model's zero3 does and reduce-scatters once after backward: predicted with
# schedule "unbroken" (plan/cost.py).
RUNNABLE = ("ddp", "zero1", "zero3")


def cache_path(model, batch_size: int, ranks_per_host: int) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unbroken"
    key = hashlib.sha256(json.dumps([dataclasses.asdict(model), batch_size, ranks_per_host]).encode()).hexdigest()[:16]
    return root / f"profile-{key}.json"


def protection_bytes(strategy: str, params: int, world: int, *, parity_group: int, protect_every: int) -> int:
    """unbroken's tier-1 memory per rank for a sharded strategy: parity (the group's windows over
    k-1 members), the snapshot of the owned state and the ring of K averaged gradients. ddp: 0
    (every survivor is a replica)."""
    if strategy == "ddp" or parity_group < 2 or world < 2:
        return 0
    state = 3 * 4 * params // world  # the owned parameters and Adam's two moments
    return state // (min(parity_group, world) - 1) + state + protect_every * 4 * params


def _topology(topology: Optional[Path], measure_to: Optional[Path], world: int, console: Console) -> Topology:
    if topology is not None and measure_to is not None:
        fail("give --topology FILE (measured before) or --measure-topology FILE (measure now), not both")
    if topology is not None:
        try:
            topo = Topology.load(topology)
        except TopologyError as e:
            fail(str(e))
        if topo.world != world:
            fail(f"{topology} was measured on {topo.world} ranks, this plan is for --world-size {world}: measure it "
                 f"again with `unbroken plan --measure-topology FILE --world-size {world}`")
        return topo
    console.print(f"[dim]measuring the wiring: {world} ranks on loopback[/]")
    with tempfile.TemporaryDirectory() as tmp:
        out = measure_to or Path(tmp) / "topology.json"
        return ranks.topology(world, out, max_bytes=16 << 20, op_budget_s=1.0, label="loopback")


def plan_predictions(prof, topo: Topology, *, parity_group: int, protect_every: int,
                     schedule: str = "fsdp") -> list[cost.Prediction]:
    """Every strategy's prediction; schedule "unbroken": zero3 as unbroken runs it (plan/cost.py),
    whose gradient ring holds one step (zero2 and zero3 bring parity up to date every step)."""
    def k(s: str) -> int:
        return 1 if schedule == "unbroken" and s in ("zero2", "zero3") else protect_every

    return [cost.predict(s, prof, topo, schedule=schedule, protection_bytes=protection_bytes(
        s, prof.params, topo.world, parity_group=parity_group, protect_every=k(s))) for s in cost.STRATEGIES]


def plan(model: str = typer.Option("tiny-gpt", "--model", help="tiny-gpt, small, or key=value,... over ModelConfig"),
         world_size: int = typer.Option(4, "--world-size", help="ranks in the job"),
         memory_limit: Optional[float] = typer.Option(None, "--memory-limit", help="GB per rank"),
         topology: Optional[Path] = typer.Option(None, "--topology", help="a topology file (plan.probe's)"),
         measure_topology: Optional[Path] = typer.Option(None, "--measure-topology",
                                                         help="measure the wiring on loopback and save it here"),
         batch_size: int = typer.Option(8, "--batch-size", help="per rank"),
         ranks_per_host: Optional[int] = typer.Option(None, "--ranks-per-host",
                                                      help="ranks sharing one host's cores (default: the world size)"),
         profile: Optional[Path] = typer.Option(None, "--profile", help="the model's profile (cached here)"),
         parity_group: int = typer.Option(4, "--parity-group", help="unbroken's tier-1 group (protection memory)"),
         protect_every: int = typer.Option(8, "--protect-every", help="unbroken's parity period (the gradient ring)"),
         strategy: str = typer.Option("auto", "--strategy", help="check one strategy (auto = choose)"),
         as_json: bool = typer.Option(False, "--json", help="print the predictions as JSON")) -> None:
    """Predict step time and memory of ddp, zero1, zero2 and zero3 and pick the fastest that fits."""
    console = Console(stderr=as_json)
    if world_size < 1 or batch_size < 1 or (memory_limit is not None and not memory_limit > 0):
        fail(f"--world-size and --batch-size must be >= 1 and --memory-limit > 0; got {world_size}, {batch_size}, "
             f"{memory_limit}")
    if strategy != "auto" and strategy not in cost.STRATEGIES:
        fail(f"unknown strategy {strategy!r}; choose one of {', '.join(cost.STRATEGIES)} or auto")
    if strategy not in ("auto", "ddp") and world_size < 2:
        fail(f"{strategy} shards over ranks and --world-size {world_size} has nothing to shard over: use ddp, "
             "or --world-size 2 or more")
    try:
        model_cfg = profiles.parse_model(model)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    rph = ranks_per_host or world_size
    topo = _topology(topology, measure_topology, world_size, console)
    console.print(f"[dim]profiling the model ({rph} processes; cached)[/]")
    prof = profiles.load_or_measure(profile or cache_path(model_cfg, batch_size, rph), model_cfg,
                                    batch_size=batch_size, ranks_per_host=rph)
    limit = memory_limit * 1e9 if memory_limit is not None else None
    try:
        preds = plan_predictions(prof, topo, parity_group=parity_group, protect_every=protect_every)
        chosen = cost.choose(preds, limit)
    except cost.PlanError as e:
        fail(str(e))
    if strategy != "auto":
        asked = next(p for p in preds if p.strategy == strategy)
        if not asked.fits(limit):
            fail(f"{strategy} needs {asked.peak_bytes / 1e9:.3g} GB per rank, over --memory-limit {memory_limit:g}: "
                 f"the planner suggests {chosen.strategy} ({chosen.peak_bytes / 1e9:.3g} GB, "
                 f"{chosen.step_s * 1e3:.0f} ms a step)")
        chosen = asked
    if as_json:
        print(json.dumps({"chosen": chosen.strategy, "predictions": [dataclasses.asdict(p) for p in preds],
                          "world": world_size, "memory_limit_bytes": limit}, indent=2))
        return
    console.print(_table(preds, chosen, limit, topo))


def _table(preds: list[cost.Prediction], chosen: cost.Prediction, limit: float | None, topo: Topology) -> Table:
    t = Table(title=f"plan: {topo.world} ranks on {topo.label or 'a measured wiring'}")
    for col in ("strategy", "step ms", "comm ms", "exposed ms", "state MiB", "peak MiB", "fits"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    for p in preds:
        t.add_row(("> " if p is chosen else "  ") + p.strategy, f"{p.step_s * 1e3:.1f}", f"{p.comm_s * 1e3:.1f}",
                  f"{p.exposed_comm_s * 1e3:.1f}", f"{p.state_bytes / 2**20:.1f}", f"{p.peak_bytes / 2**20:.1f}",
                  "yes" if p.fits(limit) else "no")
    t.caption = f"choice: {chosen.strategy}" + ("" if chosen.strategy in RUNNABLE else
                                                 f" (--strategy auto picks among {', '.join(RUNNABLE)} today)")
    return t


def choose_for_run(cfg: RunConfig) -> tuple[str, str]:
    """(strategy, why) for `unbroken run --strategy auto`: the planner's pick among the strategies
    unbroken runs, on loopback (this host), the job's model, batch and protection settings: the
    fastest whose predicted peak fits the memory this host has free per process (its workers
    and shadows), so a model too big for ddp's or zero1's replicas gets zero3.
    ConfigError (exit 2) when none fits."""
    with tempfile.TemporaryDirectory() as tmp:
        topo = ranks.topology(cfg.world_size, Path(tmp) / "topology.json", max_bytes=16 << 20, op_budget_s=1.0,
                              label="loopback")
    prof = profiles.load_or_measure(cache_path(cfg.model, cfg.batch_size, cfg.world_size), cfg.model,
                                    batch_size=cfg.batch_size, ranks_per_host=cfg.world_size)
    k = cfg.protect_every if isinstance(cfg.protect_every, int) else 8
    preds = [p for p in plan_predictions(prof, topo, parity_group=cfg.parity_group, protect_every=k,
                                         schedule="unbroken") if p.strategy in RUNNABLE]
    limit = memory_budget_bytes(cfg.world_size + cfg.shadow_pool_max, fraction=1.0)
    try:
        chosen = cost.choose(preds, limit)
    except cost.PlanError:
        least = min(preds, key=lambda p: p.peak_bytes)
        raise ConfigError(f"--strategy auto: no strategy fits in the {limit / 2**30:.2f} GiB this host has free per "
                          f"process; the smallest is {least.strategy} at {least.peak_bytes / 2**30:.2f} GiB: use "
                          "more ranks, fewer shadows or a smaller batch") from None
    why = ", ".join(f"{p.strategy} {p.step_s * 1e3:.0f} ms{'' if p.fits(limit) else ' (does not fit)'}"
                    for p in preds)
    return chosen.strategy, f"predicted step: {why}; {limit / 2**30:.1f} GiB free per process"
