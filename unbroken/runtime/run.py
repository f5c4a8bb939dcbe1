"""Run a job end to end: prepare the run directory, supervise, summarize.

`launch()` is what `unbroken run` and `unbroken demo` call; it returns the summary
that it also writes (atomically) to RUN_DIR/summary.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from unbroken.config import RunConfig
from unbroken.events import read_events
from unbroken.fsutil import atomic_write_json
from unbroken.runtime.breakdown import recoveries, resumes, segments, steps_lost_total
from unbroken.runtime.faults import FaultSpec, faults_not_fired
from unbroken.runtime.jobkey import ensure_job_key
from unbroken.runtime.resume import record_launch
from unbroken.runtime.supervisor import LaunchOptions, Supervisor, install_signal_handlers, trust_warning
from unbroken.runtime.tee import stream_writer


def new_run_dir(root: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        d = root / (stamp if i == 0 else f"{stamp}-{i}")
        if not d.exists():
            return d
    raise RuntimeError(f"cannot find a free run directory under {root}")


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    if (run_dir / "events.jsonl").exists():
        raise ValueError(f"run directory {run_dir} already holds a run; pick a new --run-dir (nothing was overwritten)")
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_json(run_dir / "config.json", cfg.to_dict())


def launch(cfg: RunConfig, opts: LaunchOptions, *, console: Console | None = None, progress: bool = True,
           tee_to_stderr: bool = False) -> dict:
    """`tee_to_stderr`: the ranks' lines (--tee) go to stderr, e.g. when stdout carries the JSON summary."""
    console = console or Console(stderr=True)
    tee_stream = sys.stderr if tee_to_stderr else sys.stdout  # the real one: the live bar redirects both
    install_signal_handlers()
    os.umask(0o077)  # everything the job writes (run directory, logs, checkpoints) is its owner's alone
    if opts.node_rank != 0:
        opts.run_dir.mkdir(parents=True, exist_ok=True)  # the supervisor writes node 0's config here
    elif not opts.resume:  # --resume: the directory, its config and key are the stopped job's (runtime/resume.py)
        prepare_run_dir(cfg, opts.run_dir)
        record_launch(opts.run_dir, opts.script)
    ensure_job_key(opts.run_dir, opts.token)  # before any worker starts: they sign their checkpoints with it
    if warning := trust_warning(opts):
        console.print(f"[bold yellow]warning:[/] {warning}")
    t0 = time.time()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                  TimeRemainingColumn(), console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("training", total=cfg.steps, loss="-", tps="-")

        def show(info: dict) -> None:
            status = info.get("status", "running")
            desc = "[yellow]" + status if status.startswith("recovering") else "training"
            loss = f"{info['loss']:.3f}" if "loss" in info else "-"
            tps = f"{info['tokens_per_s']:.0f}" if "tokens_per_s" in info else "-"
            bar.update(task, completed=info.get("step", 0), description=desc, loss=loss, tps=tps)

        try:
            sup = Supervisor(cfg, opts, on_progress=show, on_output=_tee_writer(bar, tee_stream),
                             on_finish=lambda done: summarize(cfg, opts.run_dir, wall_s=time.time() - t0, faults=opts.faults,
                                                              done=done))
        except Exception:
            if not opts.resume:
                _remove_unstarted(opts.run_dir)  # refused before any process ran: leave nothing behind
            raise
        summary = sup.run()["summary"]
    if summary is None:  # a follower that heard no summary from node 0 (excluded, or node 0 stopped)
        return {"node": opts.node_rank, "wall_s": time.time() - t0}
    atomic_write_json(opts.run_dir / "summary.json", summary)  # every node's: the whole job's (node 0's)
    return summary


def _tee_writer(bar: Progress, stream):
    """The ranks' lines: above the live progress bar when both share a terminal (raw writes
    would be overwritten by its redraws), else straight to `stream`."""
    if bar.live.is_started and bar.console.is_terminal and stream.isatty():
        return lambda text: bar.console.print(Text.from_ansi(text.removesuffix("\n")), soft_wrap=True)
    return stream_writer(stream)


def _remove_unstarted(run_dir: Path) -> None:
    """Delete a run directory that holds only what launch() wrote before the job started."""
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if names <= {"config.json", "events.jsonl", "job.key", "launch.json"}:
        for n in names:
            (run_dir / n).unlink()
        run_dir.rmdir()


def input_warnings(events) -> list[str]:
    """One line per step that was computed again with different inputs (runtime/determinism.py)."""
    by_step: dict[int, set] = {}
    for e in events:
        if e.kind == "nondeterministic_input":
            by_step.setdefault(int(e.fields["step"]), set()).update(e.fields.get("ranks", []))
    return [f"nondeterministic input at step {s} on rank(s) {sorted(r)}: a redo saw other batches than the first "
            "attempt (draw them with trainer.loader or from the step number); the weights may differ from a "
            "failure-free run" for s, r in sorted(by_step.items())]


def summarize(cfg: RunConfig, run_dir: Path, *, wall_s: float, faults: Sequence[FaultSpec] = (),
              done: dict[int, dict] | None = None) -> dict:
    """The run's summary.json from its events; `faults`: the specs injected (--inject, --chaos); `done`:
    each rank's final hash from the store, for ranks whose node's events did not reach node 0."""
    every = read_events(run_dir)
    events = segments(every)[-1]  # after `--resume`: this launch's own events (generation numbers restart)
    resumed = resumes(every)
    injected = [{"kind": e.kind, "rank": e.rank, "node": e.node, "fields": e.fields}
                for e in events if e.kind == "fault_injected"]
    done_events = [e for e in events if e.kind == "worker_done"]
    shas = {e.rank: e.fields["weights_sha256"] for e in done_events}
    for r, rec in (done or {}).items():
        shas.setdefault(r, rec["sha256"])
    steps = [e for e in events if e.kind == "step" and e.rank == 0]
    ever = [e for e in every if e.kind == "step" and e.rank == 0]  # a resumed job's earlier launches too
    last = max(ever, key=lambda e: e.fields["step"]) if ever else None
    tokens = cfg.steps * cfg.world_size * cfg.batch_size * cfg.model.seq_len
    train_s = (steps[-1].time - steps[0].time) if len(steps) > 1 else wall_s
    per_step_tokens = cfg.world_size * cfg.batch_size * cfg.model.seq_len
    recs = recoveries(events)
    # ranks lost after their peers finished, the job finished without them (runtime/stranded.py)
    after = {r for e in events if e.kind == "recovery_abandoned" and e.fields["outcome"] == "finish"
             for r in e.fields["lost"]} - set(shas)
    every_rank = set(shas) | after == set(range(cfg.world_size))
    agree = len(set(shas.values())) == 1 and every_rank
    return {
        "steps": last.fields["step"] if last else 0,
        "world_size": cfg.world_size,
        "strategy": cfg.strategy,
        "final_loss": last.fields["loss"] if last else None,
        "tokens_per_s": per_step_tokens * (len(steps) - 1) / train_s if len(steps) > 1 else tokens / wall_s,
        "weights_sha256": shas.get(0),
        "ranks_agree": agree,
        "ranks_lost_after_finish": sorted(after),
        "rank_weights_sha256": {str(r): s for r, s in sorted(shas.items())},
        "wall_s": wall_s,
        "recoveries": recs,
        "faults": sum(1 for e in events if e.kind == "fault_detected"),
        # injected specs no fault_injected event accounts for: they could have fired but did not
        "faults_not_fired": [str(f) for f in faults_not_fired(faults, injected)],
        "overlap": next((e.fields for e in reversed(events) if e.kind == "overlap_plan" and e.rank == 0), None),
        "steps_planned": next((e.fields["steps"] for e in reversed(events) if e.kind == "steps_planned"), None),
        "warnings": input_warnings(events),
        "resumes": resumed,
        "steps_lost": _lost(steps_lost_total(events), resumed),  # measured from the events (runtime/breakdown.py)
        # the script decides how many steps it runs (trainer.steps(n)); ok = every rank finished, in agreement
        # (or was lost after the others finished the last step)
        "ok": agree and last is not None,
    }


def _lost(in_place: int | None, resumed: list[dict]) -> int | None:
    """Steps lost by recoveries plus those recomputed after each --resume (None if unknown)."""
    parts = [in_place, *(r["steps_lost"] for r in resumed)]
    return None if any(p is None for p in parts) else sum(parts)


def load_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
