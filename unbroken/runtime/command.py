"""`unbroken run` and `unbroken demo`: the CLI face of the runtime."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unbroken.cli_error import fail
from unbroken.comm import native_ring
from unbroken.config import SHARDED, ConfigError, RunConfig, build_config
from unbroken.runtime.faults import NODE_KINDS, FaultSpec, chaos_schedule, check_reachable
from unbroken.runtime import auth, cluster_env
from unbroken.runtime.cluster_env import NodePlace
from unbroken.runtime.overlap_tune import checked_overlap
from unbroken.runtime.resume import load_job
from unbroken.runtime.run import launch, new_run_dir
from unbroken.runtime.crash import SoftwareFault
from unbroken.runtime.devices import resolve_backend
from unbroken.runtime.supervisor import LaunchError, LaunchOptions
from unbroken.runtime.tee import check_tee_ranks

BUILTIN_JOB = "unbroken.jobs.tiny_gpt"

# `--strategy auto` asks the planner (a tool: the runtime may not import it); cli.py plugs it in
AutoStrategy = Callable[[RunConfig], "tuple[str, str]"]
_auto_strategy: list[AutoStrategy] = []


def set_auto_strategy(choose: AutoStrategy) -> None:
    """Who answers `--strategy auto`: choose(cfg) -> (strategy, why)."""
    _auto_strategy[:] = [choose]


def _resolve_auto(overrides: dict, config, nnodes: int | None) -> RunConfig:
    """The config with the planner's strategy in place of auto."""
    if (nnodes or _place().nnodes or 1) > 1:
        raise ConfigError("--strategy auto measures this host's wiring only; for several nodes run `unbroken plan "
                          "--topology FILE` and pass its choice as --strategy")
    if not _auto_strategy:
        raise ConfigError("--strategy auto needs the planner (unbroken.plan), which this entry point did not load")
    cfg = build_config(config, **{**overrides, "strategy": None})
    strategy, why = _auto_strategy[0](cfg)
    typer.secho(f"strategy auto: {strategy} ({why})", err=True)
    return dataclasses.replace(cfg, strategy=strategy)


def _place() -> NodePlace:
    """What the launcher's environment (torchrun, Kubernetes/TorchX, Slurm) says about this node."""
    try:
        return cluster_env.from_env(os.environ)
    except cluster_env.ClusterEnvError as e:
        fail(str(e))


def _int_or_auto(flag: str, text: str | None, example: str) -> int | str | None:
    """A flag taking an integer or 'auto' (validated again by the config)."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        fail(f"{flag} must be an integer or 'auto', got {text!r}; e.g. {flag} {example}")


def run(
    script: Optional[List[str]] = typer.Argument(None, help="training script (.py) and its args; default: built-in tiny GPT"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML/JSON config file (CLI flags win)"),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="number of ranks (default 4, or WORLD_SIZE)"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="zero1 (sharded optimizer, default), zero2 (+ gradients reduce-scattered), zero3 (+ parameters "
                                                                     "sharded, gathered per block), ddp, fsdp (torch's FSDP2 "
                                                                     "fully_shard, protected as zero3), or auto "
                                                                     "(the planner's pick on this host)"),
    parity_group: Optional[int] = typer.Option(None, "--parity-group"),
    chunk_kb: Optional[int] = typer.Option(None, "--chunk-kb", help="transaction/parity chunk size"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help="tier-2 checkpoint period (0 = off)"),
    shadows: Optional[str] = typer.Option(None, "--shadows", help="pre-started shadows per node, or auto (sized "
                                                                  "from the observed failure rate)"),
    retry_budget: Optional[int] = typer.Option(None, "--retry-budget",
                                               help="recovery attempts per incident (until a step completes)"),
    max_recoveries_per_hour: Optional[int] = typer.Option(None, "--max-recoveries-per-hour",
                                                          help="rate limit over any hour (0 = no limit)"),
    on_nonfinite: Optional[str] = typer.Option(None, "--on-nonfinite",
                                               help="a gradient that stays NaN/Inf after the retries: stop "
                                                    "(default) or skip the step"),
    backend: Optional[str] = typer.Option(None, "--backend", help="data collectives: auto (nccl when CUDA is "
                                                                  "available, else gloo), gloo or nccl"),
    device: Optional[str] = typer.Option(None, "--device", help="where ranks train: auto (the backend's: cuda under "
                                                                "nccl, else cpu), cpu or cuda (with gloo: ranks "
                                                                "share the GPUs)"),
    collectives: Optional[str] = typer.Option(None, "--collectives",
                                              help="gradient all-reduce of ddp/zero1: gloo (default), static "
                                                   "(our ring), adaptive (re-planned around slow links), chain "
                                                   "(several ranks per node: half the bytes over 2 nodes' link) or "
                                                   "shm (one host: shared memory, no TCP loopback)"),
    protect_every: Optional[str] = typer.Option(None, "--protect-every",
                                                help="bring tier-1 parity up to date every K steps (1 = every step, "
                                                     "or auto)"),
    overlap: Optional[str] = typer.Option(None, "--overlap", help="gradient all-reduce: on (during backward, "
                                                                  "default), off (after backward), auto (tuned "
                                                                  "at start, cached) or a plan FILE.json"),
    n_layer: Optional[int] = typer.Option(None, "--n-layer"),
    n_embd: Optional[int] = typer.Option(None, "--n-embd"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="run directory (default: a new one under runs/)"),
    host: Optional[str] = typer.Option(None, "--host", help="store address (default MASTER_ADDR, PET_MASTER_ADDR, the first host of SLURM_JOB_NODELIST, or 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="store port (default MASTER_PORT, PET_MASTER_PORT, one derived from SLURM_JOB_ID, or a free one)"),
    store: Optional[str] = typer.Option(None, "--store", help="the job's store: etcd://HOST:PORT[,HOST:PORT...]/JOB "
                                                              "(replicated: survives any one node, node 0 included; "
                                                              "see `unbroken store`); default: node 0's TCPStore"),
    token: Optional[str] = typer.Option(None, "--token", help="join token for multi-node (visible in ps: prefer "
                                                              "--token-file or UNBROKEN_TOKEN)"),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="file holding the join token (mode 0600)"),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="number of nodes (default NNODES, PET_NNODES, SLURM_NNODES or 1)"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="this node's index (default NODE_RANK, GROUP_RANK, PET_NODE_RANK, SLURM_NODEID or 0)"),
    inject: Optional[List[str]] = typer.Option(None, "--inject", help="fault, e.g. sigkill:rank=2,step=30,phase=backward"),
    chaos: Optional[str] = typer.Option(None, "--chaos", help="random kills, e.g. seed=1,rate=0.05"),
    tee: str = typer.Option("0", "--tee", help="whose output to show, each line prefixed [rank N]: a rank, a comma "
                                               "list (0,3), all or none (logs/PROC.log keep everything)"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON (the ranks' lines go to stderr)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue the stopped job in this run directory "
                                                                 "from its newest valid checkpoint"),
) -> None:
    """Run a training job under unbroken (torchrun-compatible env vars are honoured)."""
    summary = _launch_from_flags(dict(locals()))
    if json_out:
        print(json.dumps(summary, indent=2, default=str))
    elif "steps" in summary:
        print_summary(summary)
    if "ok" in summary and not summary["ok"]:
        raise typer.Exit(1)


def _launch_from_flags(a: dict) -> dict:
    """`unbroken run`'s flags (its locals) -> the launch, and its summary."""
    if a["resume"] is not None:
        _refuse_job_changes(a)
    overrides = {k: a[k] for k in ("steps", "seed", "batch_size", "lr", "strategy", "parity_group", "chunk_kb",
                                   "checkpoint_every", "retry_budget", "max_recoveries_per_hour", "on_nonfinite",
                                   "backend", "device", "collectives", "overlap")}
    overrides.update(world_size=a["world_size"] if a["world_size"] is not None else _place().world_size,
                     shadows=_int_or_auto("--shadows", a["shadows"], "2"),
                     protect_every=_int_or_auto("--protect-every", a["protect_every"], "8"),
                     model_n_layer=a["n_layer"], model_n_embd=a["n_embd"])
    return _launch(script=a["script"], config=a["config"], run_dir=a["resume"] or a["run_dir"], host=a["host"],
                   port=a["port"], store=a["store"], token=_join_token(a["token"], a["token_file"]),
                   resume=a["resume"] is not None, nnodes=a["nnodes"], node_rank=a["node_rank"], inject=a["inject"],
                   chaos=a["chaos"], progress=not a["no_progress"], tee=a["tee"], tee_to_stderr=a["json_out"],
                   overrides=overrides)


# what defines the job: `--resume` takes all of it from the run directory
_JOB_FLAGS = {"script": "a script", "config": "--config", "run_dir": "--run-dir", "world_size": "--world-size",
              "steps": "--steps", "seed": "--seed", "batch_size": "--batch-size", "lr": "--lr",
              "strategy": "--strategy", "parity_group": "--parity-group", "chunk_kb": "--chunk-kb",
              "checkpoint_every": "--checkpoint-every", "protect_every": "--protect-every", "backend": "--backend",
              "device": "--device", "collectives": "--collectives", "overlap": "--overlap", "n_layer": "--n-layer", "n_embd": "--n-embd"}


def _refuse_job_changes(given: dict) -> None:
    changed = [flag for name, flag in _JOB_FLAGS.items() if given.get(name)]
    if changed:
        fail(f"--resume continues the job exactly as it was launched: drop {', '.join(changed)}")


def _join_token(flag: str | None, path: Path | None) -> str | None:
    """--token-file, else --token (warned: any local user sees it in ps), else UNBROKEN_TOKEN."""
    if path is not None and flag is not None:
        fail("pass the join token one way: --token-file or --token, not both")
    if path is not None:
        try:
            return auth.read_token_file(path)
        except ValueError as e:
            fail(str(e))
    if flag is not None:
        typer.secho("warning: --token is visible to every local user in ps; use --token-file or UNBROKEN_TOKEN",
                    err=True, fg=typer.colors.YELLOW)
        return flag
    return os.environ.get("UNBROKEN_TOKEN") or None


def _launch(*, script, config, run_dir, host, port, token, store=None, nnodes, node_rank, inject, chaos, progress,
            overrides: dict, resume: bool = False, tee: str = "0", tee_to_stderr: bool = False) -> dict:
    try:
        if resume:
            cfg = None
        elif overrides.get("strategy") == "auto":
            cfg = _resolve_auto(overrides, config, nnodes)
        else:
            cfg = build_config(config, **overrides)
        if resume:
            cfg, script = load_job(run_dir)
        faults = [FaultSpec.parse(s) for s in (inject or [])]
        if chaos:
            faults += chaos_schedule(chaos, world=cfg.world_size, steps=cfg.steps)
        if script and script[0].endswith(".py") and not Path(script[0]).is_file():
            raise ConfigError(f"training script {script[0]} not found")
        job = (BUILTIN_JOB,)
        if script:
            job = (str(Path(script[0]).resolve()) if script[0].endswith(".py") else script[0], *script[1:])
        _check_faults_reachable(faults, cfg, builtin=job[0] == BUILTIN_JOB)
        place = _place()
        opts = LaunchOptions(
            script=job,
            run_dir=(run_dir or new_run_dir()).resolve(),
            host=host or place.host or "127.0.0.1",
            port=port if port is not None else (place.port or 0),
            token=token, nnodes=nnodes or place.nnodes or 1,
            node_rank=node_rank if node_rank is not None else (place.node_rank or 0),
            faults=tuple(faults), resume=resume, tee=tee, store=store)
        cfg, plan_file = checked_overlap(cfg)  # a plan file's contents (bucket size, cores): PlanError, exit 2
        _check_one_host_collectives(cfg, opts.nnodes)
        cfg = _one_member_per_node(cfg, opts.nnodes)
        _check_node_faults(faults, cfg.world_size, opts.nnodes, replicated=store is not None)
        cfg = resolve_backend(cfg, nnodes=opts.nnodes)
        check_tee_ranks(tee, cfg.world_size)
        _build_ring_walk(cfg, plan_file)
        return launch(cfg, opts, progress=progress, tee_to_stderr=tee_to_stderr)
    except SoftwareFault as e:
        typer.secho(f"stopped, not retried: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)
    except (ConfigError, ValueError, LaunchError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        typer.secho("interrupted: every process of the job was stopped", err=True)
        raise typer.Exit(130)


def _build_ring_walk(cfg: RunConfig, plan_file: dict | None) -> None:
    """Our ring all-reduce (--collectives adaptive|static, or `plan_file` (its JSON) naming them) walks in
    C++ once built (comm/native_ring.py): build it here, once per machine, never inside a collective;
    without a compiler the Python walk runs."""
    named = {cfg.collectives, ((plan_file or {}).get("plan") or {}).get("collectives")}
    if not named & {"adaptive", "static"} or native_ring.module() is not None or not native_ring.enabled():
        return
    typer.secho("building the compiled ring walk (once per machine, ~40 s; UNBROKEN_NATIVE=0 skips it)", err=True)
    why = native_ring.build()
    if why:
        typer.secho(f"{why}: the ring walks in Python", err=True)


def _check_one_host_collectives(cfg: RunConfig, nnodes: int) -> None:
    if cfg.collectives == "shm" and nnodes > 1:
        raise ConfigError(f"--collectives shm reduces through one host's shared memory, but this job spans {nnodes} "
                          "nodes; use --collectives chain (several ranks per node) or gloo")


def _one_member_per_node(cfg: RunConfig, nnodes: int) -> RunConfig:
    """Parity groups take one rank per node (parallel/groups.py strides them), so a group has at most
    `nnodes` members: then a lost node costs each group one member and tier 1 rebuilds it."""
    if nnodes < 2 or cfg.effective_parity_group <= nnodes:
        return cfg
    typer.secho(f"parity group {cfg.parity_group} > {nnodes} nodes: using {nnodes} (one member per node), so that "
                "losing a whole node is recovered from tier 1", err=True, fg=typer.colors.YELLOW)
    return cfg.replace(parity_group=nnodes)


def _check_faults_reachable(faults: list[FaultSpec], cfg: RunConfig, *, builtin: bool) -> None:
    """Refuse specs that can never fire. The step count is known up front when it was given
    (--steps or the config file) or the job is the built-in one (it runs exactly cfg.steps);
    otherwise the script decides it."""
    tier1 = cfg.tier1 and cfg.strategy in SHARDED and cfg.effective_parity_group >= 2  # as worker.py builds it
    check_reachable(faults, world_size=cfg.world_size, steps=cfg.steps if cfg.steps_given or builtin else None,
                    tier1=tier1, checkpoint_every=cfg.checkpoint_every)


def _check_node_faults(faults: list[FaultSpec], world: int, nnodes: int, *, replicated: bool = False) -> None:
    """nodekill/nodestop take down the rank's whole node: never node 0 while it hosts the store
    (TCPStore); on the replicated store (etcd) any node may go."""
    local = world // nnodes if world % nnodes == 0 else world
    for f in faults:
        if f.kind in NODE_KINDS and nnodes > 1 and replicated:
            continue
        if f.kind in NODE_KINDS and f.rank // local == 0:
            raise ConfigError(f"fault {f} would take down node 0, which hosts the job's store; name a rank on "
                              f"node 1..{nnodes - 1} (ranks {local}..{world - 1}), or use the replicated store "
                              "(--store etcd://...)" if nnodes > 1 else
                              f"fault {f} takes down a whole node: it needs a job of several nodes (--nnodes)")


def print_summary(s: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="run summary", show_header=False)
    for key in ("steps", "world_size", "strategy", "final_loss", "tokens_per_s", "wall_s", "weights_sha256",
                "ranks_agree", "faults", "steps_lost"):
        v = s.get(key)
        t.add_row(key, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(t)
    for line in s.get("warnings") or []:
        console.print(f"[bold yellow]warning:[/] {escape(line)}")
    unfired = s.get("faults_not_fired") or []
    if unfired:
        console.print(f"[bold yellow]warning:[/] {len(unfired)} injected fault(s) never fired: "
                      f"{escape(', '.join(map(str, unfired)))} (no fault_injected event in events.jsonl)")
    recs = [r for r in s.get("recoveries", []) if r.get("complete")]
    if recs:
        rt = Table(title="recoveries (seconds)")
        for col in ("gen", "fault", "rank", "path", "shadow", "detect", "decide", "regroup", "rebuild", "redo",
                    "kill→step done"):
            rt.add_column(col)
        for r in recs:
            rt.add_row(str(r["gen"]), str(r["fault"]), str(r["rank"]), str(r["path"]), str(r.get("shadow") or "-"),
                       *(f"{r[k]:.3f}" for k in ("detect_s", "decide_s", "regroup_s", "rebuild_s", "redo_s",
                                                 "recovery_s")))
        console.print(rt)


def demo(
    steps: int = typer.Option(60, "--steps", help="training steps"),
    kill_step: int = typer.Option(30, "--kill-step", help="step at which rank 2 is SIGKILLed (0 = no failure)"),
    strategy: str = typer.Option("zero1", "--strategy", help="zero1 (tier-1 decode path) or ddp (replica path)"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir"),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="also run a failure-free reference"),
    no_progress: bool = typer.Option(False, "--no-progress"),
) -> None:
    """The main demo: 4 ranks train a tiny GPT; rank 2 is SIGKILLed mid-update and recovered in place."""
    console = Console()
    root = (run_dir or new_run_dir()).resolve()
    inject = [f"sigkill:rank=2,step={kill_step},phase=optimizer,chunk=1"] if kill_step else []
    common = dict(script=None, config=None, host=None, port=None, token=None, nnodes=None, node_rank=None,
                  chaos=None, progress=not no_progress)
    overrides = dict(world_size=4, steps=steps, strategy=strategy)
    ref = None
    if reference:
        console.rule("[bold]1/2 failure-free reference run")
        ref = _launch(run_dir=root / "reference", inject=[], overrides=overrides, **common)
    console.rule(f"[bold]{'2/2 ' if reference else ''}run with an injected failure: "
                 f"SIGKILL rank 2 at step {kill_step}, in the middle of its optimizer update")
    got = _launch(run_dir=root / "faulted", inject=inject, overrides=overrides, **common)
    print_summary(got, console)
    lost = got.get("steps_lost")
    console.print(f"[bold]{lost if lost is not None else '?'} steps lost[/]; "
                  f"{len(got.get('recoveries', []))} recovery(ies); all ranks agree: {got.get('ranks_agree')}")
    if ref is not None:
        same = ref.get("weights_sha256") == got.get("weights_sha256")
        colour = "green" if same else "red"
        console.print(f"[{colour}]final weights {'==' if same else '!='} failure-free reference "
                      f"(sha256 {str(got.get('weights_sha256'))[:16]}… vs {str(ref.get('weights_sha256'))[:16]}…)[/]")
        if not same:
            raise typer.Exit(1)
    console.print(f"run directory: {root}  (try: unbroken report {root / 'faulted'})")
    if not got.get("ok"):
        raise typer.Exit(1)
