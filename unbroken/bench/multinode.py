"""`unbroken bench multinode`: tokens/s of one job on 1 node x 4 ranks, 2 x 2 and 2 x 4, per link profile.

Each node is a network namespace of its own (plan/netns.py: veth + bridge, `tc tbf` at the
profile's rate), with its own run directory, started the way a user starts it (`unbroken run
--nnodes N --node-rank R --host ADDR`, the token in UNBROKEN_TOKEN). The native peer is the same
job (model, batches, AdamW, clipping) as plain torch DDP under torchrun's multi-node launch
(static rendezvous at node 0's address). Every layout runs both systems, interleaved over
`rounds`. Reported per cell: tokens/s (tokens per step / mean steady step time, rank 0),
per-rank efficiency against 1 node x 4 ranks of the same system in the same profile, and the
bytes each node's link carried, per step (whole run / steps: includes start-up traffic).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from unbroken.bench.baseline import read_log
from unbroken.bench.common import SKIP_STEPS, job_events, steady_step_times
from unbroken.config import RunConfig
from unbroken.fsutil import atomic_write_json
from unbroken.plan.netns import Netns, Wiring

LAYOUTS = ((1, 4), (2, 2), (2, 4))  # (nodes, ranks per node)
PROFILES = {"1gbit": 1000.0, "10gbit": 10000.0}
SYSTEMS = ("unbroken-ddp", "unbroken-zero1", "unbroken-zero2", "unbroken-zero3", "torchrun-ddp")
_PORT = 29611
_TOKEN = "bench-multinode"
_TIMEOUT_S = 600.0


def _tx_bytes(net: Netns, node: int) -> int:
    out = subprocess.run([*net.exec_prefix(node), "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                         capture_output=True, text=True, timeout=10, check=True)
    return int(out.stdout.strip())


def _node_env(net: Netns, node: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MASTER_", "UNBROKEN_"))}
    return {**env, **net.env(node), "UNBROKEN_TOKEN": _TOKEN, "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1"}


def _command(system: str, net: Netns, node: int, nnodes: int, cfg: RunConfig, run_dir: Path, port: int,
             extra: tuple[str, ...] = ()) -> list[str]:
    host = net.address(0)
    if system.startswith("unbroken"):
        return [*net.exec_prefix(node), sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir),
                "--no-progress", "--json", "--tee", "none", "--nnodes", str(nnodes), "--node-rank", str(node),
                "--host", host, "--port", str(port), "--world-size", str(cfg.world_size), "--steps", str(cfg.steps),
                "--strategy", cfg.strategy, *extra]
    run_dir.mkdir(parents=True)
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    return [*net.exec_prefix(node), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--node-rank", str(node), "--nproc-per-node", str(cfg.world_size // nnodes), "--master-addr", host,
            "--master-port", str(port), "-m", "unbroken.bench.baseline_job", "--run-dir", str(run_dir),
            "--checkpoint-every", "0", "--optimizer", "adamw"]


def run_once(system: str, net: Netns, nnodes: int, cfg: RunConfig, root: Path, port: int,
             extra: tuple[str, ...] = ()) -> dict:
    """One job on `nnodes` namespaces (`extra`: more `unbroken run` flags); every process it started
    is reaped before this returns. Node n's run directory is root/node{n}."""
    dirs = [root / f"node{n}" for n in range(nnodes)]
    before = [_tx_bytes(net, n) for n in range(nnodes)]
    procs = []
    try:
        for n in range(nnodes):
            log = open(root / f"node{n}.out", "wb")
            procs.append(subprocess.Popen(_command(system, net, n, nnodes, cfg, dirs[n], port, extra),
                                          env=_node_env(net, n, cfg.threads), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            log.close()
        for p in procs:
            p.wait(timeout=_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode for p in procs):
        bad = next(n for n, p in enumerate(procs) if p.returncode)  # the first node that failed says why
        tail = (root / f"node{bad}.out").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"{system} on {nnodes} node(s) failed (exit {[p.returncode for p in procs]}; "
                           f"node {bad}'s last lines): {tail}")
    sent = sum(_tx_bytes(net, n) - b for n, b in enumerate(before))
    if system.startswith("unbroken"):
        times = steady_step_times(job_events(dirs[0]))
    else:
        times = [r["step_s"] for r in read_log(dirs[0]) if r["event"] == "step" and r["step"] > SKIP_STEPS]
    tokens = cfg.world_size * cfg.batch_size * cfg.model.seq_len
    return {"tokens_per_s": tokens / statistics.fmean(times), "mean_step_s": statistics.fmean(times),
            "bytes_on_wire_per_step": sent / cfg.steps if nnodes > 1 else 0.0}


def measure(*, steps: int = 24, rounds: int = 2, profiles: tuple[str, ...] = tuple(PROFILES), log=print) -> dict:
    cells: dict[str, dict[str, dict[str, list[dict]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for profile in profiles:
            for nnodes, per in LAYOUTS:
                layout = f"{nnodes}x{per}"
                runs = cells.setdefault(profile, {}).setdefault(layout, {s: [] for s in SYSTEMS})
                with Netns(Wiring.uniform(profile, nnodes, PROFILES[profile])) as net:
                    for r in range(rounds):
                        for system in SYSTEMS:
                            log(f"{profile} {layout}: {system} round {r + 1}/{rounds}")
                            cfg = RunConfig(world_size=nnodes * per, steps=steps, strategy=system.split("-")[1])
                            root = Path(tmp) / f"{profile}-{layout}-{system}-{r}"
                            root.mkdir()
                            port = _PORT + len(runs[system]) * len(SYSTEMS) + SYSTEMS.index(system)  # no TIME_WAIT
                            runs[system].append(run_once(system, net, nnodes, cfg, root, port))
    return result(cells, steps=steps, rounds=rounds)


def result(cells: dict, *, steps: int, rounds: int) -> dict:
    """Per profile x layout x system: mean tokens/s over rounds, efficiency vs 1x4 per rank."""
    rows = []
    for profile, layouts in cells.items():
        base = {s: statistics.fmean(x["tokens_per_s"] for x in layouts["1x4"][s]) / 4 for s in SYSTEMS}
        for layout, systems in layouts.items():
            world = int(layout.split("x")[0]) * int(layout.split("x")[1])
            for s, runs in systems.items():
                tps = statistics.fmean(x["tokens_per_s"] for x in runs)
                rows.append({"profile": profile, "layout": layout, "system": s, "tokens_per_s": tps,
                             "tokens_per_s_runs": [x["tokens_per_s"] for x in runs],
                             "efficiency": tps / world / base[s],
                             "bytes_on_wire_per_step": statistics.fmean(x["bytes_on_wire_per_step"] for x in runs)})
    by = {(r["profile"], r["layout"], r["system"]): r for r in rows}
    for r in rows:
        peer = by[(r["profile"], r["layout"], "torchrun-ddp")]["tokens_per_s"]
        r["ratio_vs_torchrun_ddp"] = r["tokens_per_s"] / peer
    return {"steps": steps, "rounds": rounds, "layouts": [f"{a}x{b}" for a, b in LAYOUTS],
            "profiles_mbit": {p: PROFILES[p] for p in cells}, "rows": rows,
            "tokens_per_s": {p: {lay: {s: by[(p, lay, s)]["tokens_per_s"] for s in SYSTEMS} for lay in ls}
                             for p, ls in cells.items()},
            "efficiency": {p: {lay: {s: by[(p, lay, s)]["efficiency"] for s in SYSTEMS} for lay in ls}
                           for p, ls in cells.items()}}


def kept_sections(path: Path) -> dict:
    """What other benchmarks wrote into multinode.json (`regroup_fit`, bench/regroup.py; the node-loss
    sections, bench/node_loss.py), kept on rewrite."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    return {k: old[k] for k in ("regroup_fit", "node_loss", "node0_loss", "store_cost") if k in old}


def table(res: dict) -> Table:
    t = Table(title=f"multi-node scaling: {res['steps']} steps x {res['rounds']} rounds, nodes in namespaces")
    for col in ("profile", "layout", "system", "tokens/s", "per-rank efficiency", "vs torchrun DDP", "MB on wire/step"):
        t.add_column(col)
    for r in res["rows"]:
        t.add_row(r["profile"], r["layout"], r["system"], f"{r['tokens_per_s']:.0f}", f"{r['efficiency']:.2f}",
                  f"{r['ratio_vs_torchrun_ddp']:.2f}x", f"{r['bytes_on_wire_per_step'] / 1e6:.1f}")
    return t


def plot(res: dict, path: Path) -> None:
    from unbroken.figures import plt, save_png

    profiles = list(res["tokens_per_s"])
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), dpi=120, squeeze=False)
    try:
        for ax, p in zip(axes[0], profiles):
            width = 0.8 / len(SYSTEMS)
            for i, s in enumerate(SYSTEMS):
                xs = [j + (i - (len(SYSTEMS) - 1) / 2) * width for j in range(len(res["layouts"]))]
                ax.bar(xs, [res["tokens_per_s"][p][lay][s] for lay in res["layouts"]], width=width, label=s)
            ax.set_xticks(range(len(res["layouts"])), res["layouts"])
            ax.set_title(f"{p} links"), ax.set_xlabel("nodes x ranks"), ax.set_ylabel("tokens/s")
            ax.legend(fontsize=8)
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)
