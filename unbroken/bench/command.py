"""`unbroken bench throughput|protect|recovery|overhead|interval`: run one, print its table, save JSON (+PNG)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from unbroken.bench.common import RESULTS_DIR, write_result
from unbroken.cli_error import fail
from unbroken.bench.interval import interval  # noqa: F401  (the command lives with its benchmark)

_OUT = typer.Option(RESULTS_DIR, "--out", help="directory for NAME.json (and NAME.png)")
_QUICK = typer.Option(False, "--quick", help="smoke run: fewer steps and repeats")
_DEVICE = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (nccl with a GPU per rank, else gloo with "
                                                "the ranks sharing the GPUs, collectives staged through host memory)")


def _placement(device: str, ranks: int) -> tuple[str, str]:
    """(backend, device) of a benchmark's runs of up to `ranks` ranks on `device`: nccl when every rank
    has a GPU of its own, else gloo with ranks sharing the GPUs. A device this host lacks: one line, exit 2."""
    import torch

    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda needs CUDA, but torch.cuda.is_available() is False on this host; "
             "run without --device (the CPU)")
    if device == "cpu":
        return "gloo", "cpu"
    return ("nccl" if ranks <= torch.cuda.device_count() else "gloo"), "cuda"


def _on_device(res: dict, backend: str, device: str) -> dict:
    """The result with the device its figures were measured on, and how its ranks reached it."""
    import torch

    if device != "cuda":
        return {**res, "device": "cpu", "backend": backend}
    sharing = "one rank per GPU" if backend == "nccl" else "ranks share the GPU(s), collectives staged through host"
    return {**res, "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "backend": backend,
            "placement": sharing}


def _finish(name: str, res: dict, table, out: Path) -> None:
    console = Console()
    console.print(table(res))
    path = write_result(name, res, out)
    console.print(f"wrote {path}")


def throughput(quick: bool = _QUICK, out: Path = _OUT,
               steps: int = typer.Option(0, "--steps", help="steps per run (default 20, quick 6)")) -> None:
    """Tokens/s at 1, 2 and 4 ranks: unbroken's scaling (the comparison with native PyTorch: bench overhead)."""
    from unbroken.bench import throughput as tp

    if steps < 0:
        raise typer.BadParameter(f"--steps must be >= 0 (0 = default), got {steps}")
    res = tp.measure(steps=steps or (6 if quick else 20))
    _finish("throughput", res, tp.table, out)


def protect(quick: bool = _QUICK, out: Path = _OUT) -> None:
    """Parity encode vs memcpy, rebuild time of one rank, memory overhead (step overhead: bench overhead)."""
    from unbroken.bench import protect as pr

    res = pr.measure(quick=quick)
    _finish("protect", res, pr.table, out)


def recovery(quick: bool = _QUICK, out: Path = _OUT, device: str = _DEVICE) -> None:
    """torchrun restart-all + Young/Daly checkpoints vs unbroken in place, same job and SIGKILL schedule."""
    from unbroken.config import RunConfig

    backend, device = _placement(device, RunConfig().world_size)
    from unbroken.bench import recovery as rc

    res = _on_device(rc.measure(quick=quick, plot_path=Path(out) / "recovery.png", backend=backend, device=device),
                     backend, device)
    _finish("recovery", res, rc.table, out)


def _int_list(text: str, option: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise typer.BadParameter(f"{option} takes comma-separated integers >= 1, e.g. 2,4; got {text!r}")
    return [int(p) for p in parts]


def _strategies(text: str) -> list[str]:
    from unbroken.config import STRATEGIES

    names = [p.strip() for p in text.split(",") if p.strip()] or list(STRATEGIES)
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        raise typer.BadParameter(f"unknown strategy {bad[0]!r}; choose from {', '.join(STRATEGIES)}")
    return names


def overhead(steps: int = typer.Option(40, "--steps", help="steps per run"),
             rounds: int = typer.Option(5, "--rounds", help="interleaved rounds of native, off, default"),
             worlds: str = typer.Option("2,4", "--worlds", help="world sizes, comma-separated"),
             strategies: str = typer.Option("", "--strategies", help="comma-separated; default: every strategy"),
             out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="for overhead.json and overhead.png"),
             device: str = _DEVICE) -> None:
    """Failure-free cost: unbroken (protection off, and default) vs native PyTorch, tokens/s ratio with 95% CI."""
    sizes, names = _int_list(worlds, "--worlds"), _strategies(strategies)
    backend, device = _placement(device, max(sizes))  # before the slow imports
    from unbroken.bench import overhead as ov
    from unbroken.bench.plot import plot_overhead

    if rounds < 1:
        raise typer.BadParameter(f"--rounds must be >= 1, got {rounds}")
    try:
        ov.validate(steps=steps, worlds=sizes, strategies=names)
    except ValueError as e:  # a ConfigError, or --steps too short to have steady steps
        raise typer.BadParameter(str(e)) from None
    res = _on_device(ov.measure(steps=steps, rounds=rounds, worlds=sizes, strategies=names, backend=backend,
                                device=device), backend, device)
    _finish("overhead", res, ov.table, out_dir)
    plot_overhead(res, Path(out_dir) / "overhead.png")
    Console().print(f"wrote {Path(out_dir) / 'overhead.png'}")


def strategies(steps: int = typer.Option(30, "--steps", help="steps per run"),
               rounds: int = typer.Option(3, "--rounds", help="interleaved rounds of native, unbroken"),
               world: int = typer.Option(4, "--world-size", help="ranks"),
               names: str = typer.Option("", "--strategies", help="comma-separated; default: ddp,zero1,zero2,zero3,fsdp"),
               out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="for strategies.json")) -> None:
    """Each unbroken strategy next to its PyTorch peer: tokens/s ratio with 95% CI, memory, bytes per step."""
    from unbroken.bench import strategies as sb

    chosen = [s for s in names.split(",") if s] or list(sb.STRATEGIES)
    bad = [s for s in chosen if s not in sb.STRATEGIES]
    if bad:
        raise typer.BadParameter(f"--strategies: {', '.join(bad)} unknown; choose from {', '.join(sb.STRATEGIES)}")
    if rounds < 1 or world < 2 or steps <= 5:
        raise typer.BadParameter(f"need --rounds >= 1, --world-size >= 2, --steps > 5; got {rounds}, {world}, {steps}")
    res = sb.measure(steps=steps, rounds=rounds, world=world, strategies=chosen, console=Console(stderr=True))
    _finish("strategies", res, sb.table, out_dir)


def plan(out: Path = _OUT, world: int = typer.Option(4, "--world-size", help="ranks, one network namespace each"),
         model: str = typer.Option("small", "--model", help="tiny-gpt, small, or key=value,... over ModelConfig"),
         steps: int = typer.Option(12, "--steps", help="steps per run (the first 2 are not timed)"),
         rounds: int = typer.Option(2, "--rounds", help="runs of every strategy per wiring, interleaved"),
         quick: bool = _QUICK) -> None:
    """The planner's step-time predictions against every strategy measured on four shaped wirings (needs root)."""
    from unbroken.bench import plan as pl
    from unbroken.cli_error import fail
    from unbroken.plan.netns import available

    if world < 2 or steps < 4 or rounds < 1:
        fail(f"need --world-size >= 2, --steps >= 4, --rounds >= 1; got {world}, {steps}, {rounds}")
    if available():
        fail(f"bench plan builds network namespaces: {available()}")
    res = pl.measure(world=world, model_spec=model, steps=6 if quick else steps, rounds=1 if quick else rounds,
                     log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    pl.plot(res, Path(out) / "plan.png")
    _finish("plan", res, pl.table, out)


def multinode(out: Path = _OUT, steps: int = typer.Option(24, "--steps", help="steps per run (the first 2 are not timed)"),
              rounds: int = typer.Option(2, "--rounds", help="runs of every system per layout, interleaved"),
              profile: Optional[List[str]] = typer.Option(None, "--profile", help="link profile(s): 1gbit, 10gbit (default both)"),
              only: Optional[List[str]] = typer.Option(None, "--only", help="just these sections, merged into "
                                                       "multinode.json: scaling, node-loss, node0-loss, store-cost"),
              quick: bool = _QUICK) -> None:
    """Tokens/s and per-rank efficiency for 1x4, 2x2 and 2x4 nodes x ranks on shaped links, next to torchrun + DDP
    (needs root); then whole-node loss (node 1, node 0 on the etcd store) and the etcd store's cost."""
    from unbroken.bench import multinode as mn
    from unbroken.cli_error import fail
    from unbroken.plan.netns import available

    sections = list(dict.fromkeys(only or ["scaling", *_NODE_SECTIONS]))
    if unknown := [o for o in sections if o != "scaling" and o not in _NODE_SECTIONS]:
        fail(f"unknown --only {', '.join(unknown)}; choose from scaling, {', '.join(_NODE_SECTIONS)}")
    profiles = tuple(profile or mn.PROFILES)
    if unknown := [p for p in profiles if p not in mn.PROFILES]:
        fail(f"unknown --profile {', '.join(unknown)}; choose from {', '.join(mn.PROFILES)}")
    if steps < 6 or rounds < 1:
        fail(f"need --steps >= 6 and --rounds >= 1; got {steps}, {rounds}")
    if "scaling" in sections:
        if available():
            fail(f"bench multinode builds network namespaces: {available()}")
        res = mn.measure(steps=8 if quick else steps, rounds=1 if quick else rounds, profiles=profiles,
                         log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
        mn.plot(res, Path(out) / "multinode.png")
        _finish("multinode", {**res, **mn.kept_sections(Path(out) / "multinode.json")}, mn.table, out)
    if node := [s for s in sections if s != "scaling"]:
        _node_sections(out, node, rounds=1 if quick else max(rounds, 3))


def overlap(out: Path = _OUT, steps: int = typer.Option(20, "--steps", help="steps per run (the first 2 are not timed)"),
            rounds: int = typer.Option(3, "--rounds", help="runs of every method per config, interleaved"),
            config: Optional[List[str]] = typer.Option(None, "--config", help="loopback, 1gbit, 200mbit (default all)"),
            grad_clip: Optional[float] = typer.Option(None, "--grad-clip", help="every method's gradient clipping "
                                                      "(default the job's 1.0; 0 = off)"),
            collectives: str = typer.Option("gloo", "--collectives", help="unbroken's gradient all-reduce on the "
                                            "two-node configs: gloo, static, adaptive or chain (loopback: gloo)"),
            quick: bool = _QUICK) -> None:
    """Step time with no overlap, torch DDP, unbroken's overlap and its auto-tuned plan: loopback (compute-bound)
    and 1 Gbit/s, 200 Mbit/s links between two namespaces (needs root); exposed communication; a one-step timeline."""
    from unbroken.bench import overlap as ob
    from unbroken.cli_error import fail
    from unbroken.config import COLLECTIVES
    from unbroken.plan.netns import available

    configs = tuple(config or ob.CONFIGS)
    if unknown := [c for c in configs if c not in ob.CONFIGS]:
        fail(f"unknown --config {', '.join(unknown)}; choose from {', '.join(ob.CONFIGS)}")
    if steps < 5 or rounds < 1:
        fail(f"need --steps >= 5 (2 warm-up, the timeline step 3, more to time) and --rounds >= 1; got {steps}, {rounds}")
    if grad_clip is not None and not grad_clip >= 0:
        fail(f"--grad-clip must be >= 0 (0 turns clipping off), got {grad_clip}")
    if collectives not in COLLECTIVES:
        fail(f"--collectives {collectives!r}: choose from {', '.join(COLLECTIVES)}")
    if any(ob.CONFIGS[c] for c in configs) and (why := available()):
        fail(f"bench overlap builds network namespaces for {', '.join(c for c in configs if ob.CONFIGS[c])}: {why} "
             "(or pass --config loopback)")
    res = ob.measure(steps=6 if quick else steps, rounds=1 if quick else rounds, configs=configs, quick=quick,
                     grad_clip=grad_clip, collectives=collectives, log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    ob.plot_timeline(res, Path(out) / "overlap.png")
    _finish("overlap", res, ob.table, out)
    Console().print(f"wrote {Path(out) / 'overlap.png'}")


_NODE_SECTIONS = {"node-loss": "node_loss", "node0-loss": "node0_loss", "store-cost": "store_cost"}


def _node_sections(out: Path, names: list[str], *, rounds: int) -> None:
    """Whole-node loss and the etcd store's cost (bench/node_loss.py), merged into multinode.json."""
    from unbroken.bench import node_loss as nl
    from unbroken.cli_error import fail
    from unbroken.runtime.etcd_cluster import missing_reason

    if {"node0-loss", "store-cost"} & set(names) and (why := missing_reason()):
        fail(f"--only {', '.join(names)} needs the etcd store: {why}")
    log = lambda m: Console(stderr=True).print(f"[dim]{m}[/]")  # noqa: E731
    run = {"node-loss": lambda: nl.measure_node_loss(log=log), "node0-loss": lambda: nl.measure_node0_loss(log=log),
           "store-cost": lambda: nl.measure_store_cost(rounds=rounds, log=log)}
    path = Path(out) / "multinode.json"
    for n in dict.fromkeys(names):  # each section written once measured: a later failure keeps it
        key, res = _NODE_SECTIONS[n], run[n]()
        Console().print(f"{key}: " + json.dumps({k: v for k, v in res.items() if k != "runs"}, default=str))
        nl.write_sections({key: res}, path)
        Console().print(f"wrote {key} into {path}")


def regroup(out: Path = _OUT, sizes: str = typer.Option("4,8,16,32,64", "--sizes", help="world sizes, comma-separated"),
            rounds: int = typer.Option(2, "--rounds", help="runs per size, interleaved")) -> None:
    """Regroup time after a kill from 4 to 64 ranks (oversubscribed), fitted; into multinode.json's regroup_fit."""
    from unbroken.bench import regroup as rg
    from unbroken.cli_error import fail

    try:
        worlds = tuple(int(s) for s in sizes.split(","))
    except ValueError:
        fail(f"--sizes must be comma-separated integers, got {sizes!r}")
    if len(set(worlds)) < 2 or min(worlds) < 2 or rounds < 1:
        fail(f"need at least two distinct --sizes >= 2 and --rounds >= 1; got {sizes!r}, {rounds}")
    res = rg.measure(sizes=worlds, rounds=rounds, log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    Console().print(rg.table(res))
    path = Path(out) / "multinode.json"
    rg.write_into_multinode(res, path)
    Console().print(f"wrote regroup_fit into {path}")


def collectives(out: Path = _OUT, world: int = typer.Option(4, "--world-size", help="ranks, one network namespace each"),
                payloads: str = typer.Option("1,4,16,64,256", "--payloads", help="MB, comma-separated"),
                rounds: int = typer.Option(3, "--rounds", help="timed rounds of every method per payload, interleaved"),
                fast: float = typer.Option(1000.0, "--fast-mbit", help="every link's rate"),
                slow: float = typer.Option(250.0, "--slow-mbit", help="a congested link's rate"),
                scenarios: str = typer.Option("", "--scenarios", help="comma-separated; default: all"),
                only: Optional[List[str]] = typer.Option(None, "--only", help="just this section, merged into "
                                                         "collectives.json: e2e (the demo job, one slow link), codec "
                                                         "(squeezed transfers' codec on this host)"),
                steps: int = typer.Option(20, "--steps", help="e2e: steps per run (the first 2 are not timed)"),
                bucket_kb: Optional[int] = typer.Option(None, "--bucket-kb", help="e2e: gradient bucket size (KiB) "
                                                        "of every method; default the job's (25600)"),
                quick: bool = _QUICK) -> None:
    """gloo's all-reduce vs our static ring vs the congestion-aware one, on shaped links in namespaces (needs root);
    `--only e2e`: the demo job's step time with one slow link under each."""
    from unbroken.bench import collectives as cb
    from unbroken.plan.netns import available

    if only:
        if bad := [o for o in only if o not in ("e2e", "codec")]:
            fail(f"unknown --only {', '.join(bad)}; choose from e2e, codec")
        if "codec" in only:
            _collectives_codec(out, quick)
        if "e2e" in only:
            _collectives_e2e(out, world=world, fast=fast, slow=slow, steps=steps, rounds=rounds, quick=quick,
                             bucket_kb=bucket_kb)
        return
    if bucket_kb is not None:
        fail("--bucket-kb is for --only e2e (the training job's buckets); drop it or add --only e2e")

    sizes = _int_list(payloads, "--payloads")
    names = tuple(s for s in scenarios.split(",") if s) or cb.SCENARIOS
    if bad := [s for s in names if s not in cb.SCENARIOS]:
        fail(f"unknown --scenarios {', '.join(bad)}; choose from {', '.join(cb.SCENARIOS)}")
    if not 2 <= world <= 64 or rounds < 1 or not 0 < slow < fast:
        fail(f"need 2 <= --world-size <= 64, --rounds >= 1 and 0 < --slow-mbit < --fast-mbit; "
             f"got {world}, {rounds}, {slow}, {fast}")
    if world < 4 and {"two_slow", "background"} & set(names):
        fail(f"scenarios two_slow and background need --world-size >= 4, got {world}")
    if why := available():
        fail(f"bench collectives builds network namespaces: {why}")
    mb = cb.MB
    res = cb.measure(world=world, payloads=[1 * mb, 16 * mb] if quick else [s * mb for s in sizes],
                     rounds=2 if quick else rounds, fast=fast, slow=slow,
                     changing_payload=16 * mb, changing_rounds=24 if quick else 60,
                     period=10.0 if quick else 20.0, scenarios=names,
                     log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    res["quick"] = quick
    cb.plot(res, Path(out) / "collectives.png")
    _finish("collectives", {**res, **cb.kept_sections(Path(out) / "collectives.json")}, cb.table, out)


def _collectives_codec(out: Path, quick: bool) -> None:
    """The `codec` section of collectives.json (bench/squeeze_codec.py), every other key kept."""
    from unbroken.bench import squeeze_codec
    from unbroken.bench.node_loss import write_sections

    res = squeeze_codec.measure(nbytes=(1 << 20) if quick else (16 << 20))
    Console().print("codec: " + json.dumps(res))
    write_sections({"codec": res}, Path(out) / "collectives.json")


def _collectives_e2e(out: Path, *, world: int, fast: float, slow: float, steps: int, rounds: int,
                     quick: bool, bucket_kb: int | None = None) -> None:
    """The `e2e` section of collectives.json (bench/collectives_e2e.py), every other key kept."""
    from unbroken.bench import collectives_e2e as e2e
    from unbroken.bench.node_loss import write_sections
    from unbroken.plan.netns import available

    if not 2 <= world <= 64 or rounds < 1 or steps < 4 or not 0 < slow < fast:
        fail(f"need 2 <= --world-size <= 64, --rounds >= 1, --steps >= 4 and 0 < --slow-mbit < --fast-mbit; "
             f"got {world}, {rounds}, {steps}, {slow}, {fast}")
    if bucket_kb is not None and bucket_kb < 1:
        fail(f"--bucket-kb must be >= 1 (KiB), got {bucket_kb}; e.g. --bucket-kb 2048")
    if why := available():
        fail(f"bench collectives --only e2e builds network namespaces: {why}")
    res = e2e.measure(world=world, fast=fast, slow=slow, steps=8 if quick else steps, rounds=1 if quick else rounds,
                      bucket_kb=bucket_kb, log=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    res["quick"] = quick
    Console().print("e2e: " + json.dumps({k: v for k, v in res.items() if k != "runs"}))
    write_sections({"e2e": res}, Path(out) / "collectives.json")
    Console().print(f"wrote e2e into {Path(out) / 'collectives.json'}")
