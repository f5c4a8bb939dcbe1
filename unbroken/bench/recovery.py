"""Recovery: torchrun restart-all + checkpoints vs unbroken in place, same job, same kills, one invocation.

Order: time one checkpoint save; a failure-free torchrun run (its step time sets the
checkpoint period by Young/Daly); torchrun with the kills; a failure-free unbroken
reference; unbroken with the same kills (weights must equal the reference's, bitwise).
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.bench import baseline
from unbroken.bench.common import goal, job_events, median, run_job, step_events, steady_step_times
from unbroken.config import RunConfig
from unbroken.runtime.faults import FaultSpec

GOAL_RATIO = 10.0
PHASES = ("detect", "decide", "regroup", "rebuild", "redo")
FULL = {"steps": 60, "kills": [(1, 16), (2, 31), (3, 47)]}
QUICK = {"steps": 30, "kills": [(1, 8), (2, 17), (3, 25)]}


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint period sqrt(2 * save cost * MTBF), in seconds."""
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost and MTBF must be > 0 seconds, got save_s={save_s}, mtbf_s={mtbf_s}")
    return math.sqrt(2.0 * save_s * mtbf_s)


def checkpoint_every_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    """The Young/Daly period rounded to whole steps (at least 1)."""
    if step_s <= 0:
        raise ValueError(f"step time must be > 0 seconds, got {step_s}")
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / step_s))


def mtbf_steps(kills: list[tuple[int, int]]) -> float:
    """Mean steps between kills, counting from the start of the run."""
    if not kills:
        raise ValueError("a kill schedule needs at least one (rank, step)")
    return max(s for _, s in kills) / len(kills)


def measure_save_s(cfg: RunConfig, repeats: int = 3) -> dict:
    """Median time of one baseline checkpoint (model + AdamW state, torch.save + fsync + rename)."""
    import torch

    from unbroken.bench import baseline_job as job
    from unbroken.models import VOCAB_SIZE
    from unbroken.models.gpt import build_model

    from unbroken.runtime.devices import rank_device

    device = rank_device(cfg.backend, local_rank=0, device=cfg.device)  # a save from the GPU includes its copy to the host
    model = build_model(cfg.model, VOCAB_SIZE, seed=cfg.seed).to(device)
    opt = job.make_optimizer(model, cfg)
    x = torch.zeros(1, 8, dtype=torch.long, device=device)
    model.loss(x, x).backward()
    opt.step()  # populate exp_avg / exp_avg_sq: the checkpoint has its real size
    times, nbytes = [], 0
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-save-") as tmp:
        for i in range(repeats):
            t0 = time.perf_counter()
            nbytes = job.save_checkpoint(Path(tmp), i + 1, model, opt)
            times.append(time.perf_counter() - t0)
    return {"save_s": statistics.median(times), "bytes": nbytes}


def unbroken_side(summary: dict, reference: dict, run_dir: Path, kills: list[tuple[int, int]], t0: float) -> dict:
    recs = [r for r in summary["recoveries"] if r.get("complete")]
    if len(recs) != len(kills):
        raise RuntimeError(f"unbroken completed {len(recs)} recoveries for {len(kills)} kills; see {run_dir}")
    events = job_events(run_dir)
    med = median(steady_step_times(events))
    steps = step_events(events)
    return {
        "recovery_s": [r["recovery_s"] for r in recs], "steps_redone": [r["steps_redone"] for r in recs],
        "steps_lost": summary["steps_lost"],
        "breakdown": {p: [r[f"{p}_s"] for r in recs] for p in PHASES},
        "path": [r["path"] for r in recs],
        "wall_s": summary["wall_s"], "median_step_s": med,
        "productive_fraction": summary["steps"] * med / summary["wall_s"],
        "failure_free_wall_s": reference["wall_s"],
        "weights_sha256": summary["weights_sha256"],
        "timeline": {"t": [e.time - t0 for e in steps], "step": [e.fields["step"] for e in steps],
                     "kills_t": [e.time - t0 for e in events if e.kind == "fault_injected"]},
    }


def recovery_result(*, steps: int, world: int, kills: list[tuple[int, int]], save: dict, mtbf_s: float,
                    every: int, base: dict, base_ref_wall: float, ub: dict, weights_match: bool,
                    state_bytes: int | None) -> dict:
    """The JSON schema of recovery.json (the simulator reads unbroken.recovery_s/breakdown, baseline.recovery_s)."""
    base, ub = {**base, "failure_free_wall_s": base_ref_wall}, dict(ub)
    for side in (base, ub):
        # wall time the kills cost this system, against its own failure-free run
        side["lost_to_failures_s"] = side["wall_s"] - side["failure_free_wall_s"]
        side["steps_per_wall_s"] = steps / side["wall_s"]
    ratio = statistics.median(base["recovery_s"]) / statistics.median(ub["recovery_s"])
    regain = statistics.median(base["regain_s"]) / statistics.median(ub["recovery_s"])
    return {
        "world_size": world, "steps": steps, "kills": [{"rank": r, "step": s} for r, s in kills],
        "baseline": {**base, "checkpoint_every": every, "save_s": save["save_s"], "checkpoint_bytes": save["bytes"],
                     "mtbf_s": mtbf_s, "young_daly_interval_s": young_daly_interval_s(save["save_s"], mtbf_s)},
        "unbroken": {**ub, "state_bytes_per_rank": state_bytes},
        "ratio": ratio, "ratio_regain": regain, "weights_match_reference": weights_match,
        "goals": {"ratio": GOAL_RATIO},
    }


def _protected_bytes(run_dir: Path) -> int | None:
    built = [e for e in job_events(run_dir) if e.kind == "parity_built"]
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    k = cfg.effective_parity_group
    return built[0].fields["bytes"] * (k - 1) if built and k >= 2 else None


def measure(*, quick: bool, console: Console | None = None, plot_path: Path | None = None,
            backend: str = "auto", device: str = "auto") -> dict:
    console = console or Console(stderr=True)
    spec = QUICK if quick else FULL
    steps, kills = spec["steps"], spec["kills"]
    cfg = RunConfig(steps=steps, backend=backend, device=device)
    save = measure_save_s(cfg)
    console.log(f"recovery: one checkpoint save takes {save['save_s']:.3f}s ({save['bytes'] / 1e6:.1f} MB)")
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-recovery-") as tmp:
        tmp = Path(tmp)
        console.log("recovery: torchrun baseline, failure-free (sets the step time for Young/Daly)")
        ref = baseline.run_baseline(cfg, tmp / "base-ref", every=steps)
        step_s = statistics.median(baseline.step_times(ref["records"]))
        mtbf_s = mtbf_steps(kills) * step_s
        every = checkpoint_every_steps(save["save_s"], mtbf_s, step_s)
        console.log(f"recovery: MTBF {mtbf_s:.1f}s, Young/Daly checkpoint every {every} steps; torchrun with kills")
        base = baseline.summary(baseline.run_baseline(cfg, tmp / "base-kill", every=every, kills=kills), kills, steps)
        base["weights_match_reference"] = base["weights_sha256"] == baseline.weights_sha256(ref["records"])
        console.log("recovery: unbroken, failure-free reference")
        ub_ref = run_job(cfg, tmp / "ub-ref", console=console)
        console.log("recovery: unbroken with the same kills")
        faults = tuple(FaultSpec.parse(f"sigkill:rank={r},step={s},phase=backward") for r, s in kills)
        ub_sum = run_job(cfg, tmp / "ub-kill", faults=faults, console=console)
        for name, s in (("reference", ub_ref), ("killed", ub_sum)):
            if not s["ok"]:
                raise RuntimeError(f"the unbroken {name} run did not finish all {steps} steps: {s}")
        t0 = next(e.time for e in job_events(tmp / "ub-kill") if e.kind == "run_start")
        ub = unbroken_side(ub_sum, ub_ref, tmp / "ub-kill", kills, t0)
        res = recovery_result(steps=steps, world=cfg.world_size, kills=kills, save=save, mtbf_s=mtbf_s, every=every,
                              base=base, base_ref_wall=ref["wall_s"], ub=ub,
                              weights_match=bool(ub_sum["weights_sha256"]) and
                              ub_sum["weights_sha256"] == ub_ref["weights_sha256"],
                              state_bytes=_protected_bytes(tmp / "ub-kill"))
    if plot_path is not None:
        from unbroken.bench.plot import plot_timelines

        plot_timelines({"torchrun restart + checkpoint": res["baseline"]["timeline"],
                        "unbroken in place": res["unbroken"]["timeline"]}, plot_path,
                       title=f"{cfg.world_size} ranks, {steps} steps, {len(kills)} SIGKILLs "
                             f"(checkpoint every {every} steps)")
    return res


def table(r: dict) -> Table:
    b, u = r["baseline"], r["unbroken"]
    t = Table(title=f"recovery, {r['world_size']} ranks x {r['steps']} steps, kills at "
                    + ", ".join(f"r{k['rank']}@{k['step']}" for k in r["kills"]))
    for col in ("", "torchrun + checkpoint", "unbroken in place", "ratio"):
        t.add_column(col, justify="right")
    fmt_list = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    t.add_row("recovery s (kill -> first step done)", fmt_list(b["recovery_s"]), fmt_list(u["recovery_s"]),
              f"{r['ratio']:.1f}x {goal(r['ratio'] >= GOAL_RATIO)} (goal >= {GOAL_RATIO:.0f}x)")
    t.add_row("kill -> killed step done again", fmt_list(b["regain_s"]), fmt_list(u["recovery_s"]),
              f"{r['ratio_regain']:.1f}x")
    t.add_row("steps redone", str(b["steps_redone"]), str(u["steps_redone"]), "")
    t.add_row("steps lost", "", str(u["steps_lost"]), "")
    t.add_row("checkpoint every (Young/Daly)", f"{b['checkpoint_every']} steps (save {b['save_s']:.3f}s, "
              f"MTBF {b['mtbf_s']:.1f}s)", "-", "")
    t.add_row("wall s (failure-free)", f"{b['wall_s']:.1f} ({b['failure_free_wall_s']:.1f})",
              f"{u['wall_s']:.1f} ({u['failure_free_wall_s']:.1f})", "")
    t.add_row("wall s lost to the kills", f"{b['lost_to_failures_s']:.1f}", f"{u['lost_to_failures_s']:.1f}",
              f"{b['lost_to_failures_s'] / max(u['lost_to_failures_s'], 1e-9):.1f}x")
    t.add_row("median step s", f"{b['median_step_s']:.3f}", f"{u['median_step_s']:.3f}", "")
    t.add_row("productive fraction (steps x own median step / wall)", f"{b['productive_fraction']:.2f}",
              f"{u['productive_fraction']:.2f}", "")
    t.add_row("steps per wall second", f"{b['steps_per_wall_s']:.3f}", f"{u['steps_per_wall_s']:.3f}", "")
    t.add_row("weights = failure-free run", str(b["weights_match_reference"]), str(r["weights_match_reference"]), "")
    for p in PHASES:
        t.add_row(f"unbroken {p} s", "", fmt_list(u["breakdown"][p]), "")
    for p in ("restart", "init", "redo"):
        t.add_row(f"baseline {p} s", fmt_list(b["breakdown"][p]), "", "")
    return t
