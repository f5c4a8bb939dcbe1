"""The timeline PNG: ranks x time per run, with injections, detections, recovery phases
and recoveries marked (matplotlib, Agg backend, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from unbroken.figures import plt, save_png  # first: selects the Agg backend

from matplotlib.lines import Line2D  # noqa: E402,I001
from matplotlib.patches import Patch  # noqa: E402

from unbroken.detect.report import RunLog, as_int, recovery_intervals, run_bounds  # noqa: E402

MAX_RUNS = 12           # more runs than this: draw the first ones and say so
MAX_RANK_BARS = 64      # above this many ranks, skip per-rank bars (markers still drawn)
PHASE_COLORS = {"detect": "#f4a261", "diagnose": "#9b5de5", "recover": "#4ea8de"}
FAULT_COLORS = {"crash": "#d62828", "exception": "#e76f51", "hang": "#6a040f", "stall": "#8d99ae",
                "straggler": "#f77f00", "numerics": "#2a9d8f", "health": "#000000"}
JOB_ROW = -1            # row for events that name no rank (a group stall, a node exclusion)


def _rows(run: RunLog) -> list[int]:
    return sorted({r for e in run.events if (r := as_int(e.rank)) is not None})


def _draw_run(ax: Any, run: RunLog, faults: list[dict[str, Any]]) -> None:
    start, end = run_bounds(run.events)
    ranks = _rows(run)
    if len(ranks) <= MAX_RANK_BARS:
        for r in ranks:
            ax.plot([0, end - start], [r, r], color="#cfd8dc", lw=6, solid_capstyle="butt", zorder=1)
    for cat, s, e in recovery_intervals(run.events, start, end):
        ax.axvspan(s - start, e - start, color=PHASE_COLORS[cat], alpha=0.35, lw=0, zorder=0)
    for e in run.events:
        t, r = e.time - start, as_int(e.rank)
        y = JOB_ROW if r is None else r
        if e.kind == "fault_injected":
            ax.plot(t, y, marker="v", mfc="none", mec="black", ms=9, zorder=3)
        elif e.kind == "recovered":
            ax.axvline(t, color="#2b9348", ls="--", lw=1.2, zorder=2)
        elif e.kind == "node_excluded":
            ax.annotate(f"node {e.fields.get('node')} excluded", (t, JOB_ROW), xytext=(3, -12),
                        textcoords="offset points", fontsize=7, color="#6a040f")
    for f in faults:
        y = JOB_ROW if f["rank"] is None else f["rank"]
        color = FAULT_COLORS.get(f["class"], "#444444")
        ax.plot(f["time_s"], y, marker="X", ms=10, zorder=4, color=color,
                mfc="white" if f["false_positive"] else color)
        ax.annotate(f["class"] + (" (FP)" if f["false_positive"] else ""), (f["time_s"], y),
                    xytext=(5, 5), textcoords="offset points", fontsize=7, color=color)
    if len(ranks) <= MAX_RANK_BARS:
        ax.set_yticks([JOB_ROW] + ranks, ["job"] + [f"rank {r}" for r in ranks])
    ax.set_ylim(JOB_ROW - 1, (max(ranks) if ranks else 0) + 1)
    ax.set_xlim(0, max(end - start, 1e-3))
    ax.invert_yaxis()
    ax.set_title(run.name, fontsize=9, loc="left")


def _legend() -> list[Any]:
    handles: list[Any] = [Patch(color=c, alpha=0.35, label=k) for k, c in PHASE_COLORS.items()]
    handles += [Line2D([], [], marker="v", ls="", mfc="none", mec="black", label="fault injected"),
                Line2D([], [], marker="X", ls="", color="#d62828", label="fault detected"),
                Line2D([], [], marker="X", ls="", color="#d62828", mfc="white", label="false positive"),
                Line2D([], [], color="#2b9348", ls="--", label="recovered")]
    return handles


def draw_timeline(runs: list[RunLog], report: dict[str, Any], path: Path) -> Path:
    """Write the timeline of `runs` (faults as classified in `report`) to `path` (PNG)."""
    shown = [r for r in runs if r.events][:MAX_RUNS]
    heights = [1.0 + 0.3 * (min(len(_rows(r)), MAX_RANK_BARS) + 1) for r in shown] or [2.0]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, 0.8 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    try:
        for ax, run in zip(axes[:, 0], shown):
            _draw_run(ax, run, [f for f in report["faults"] if f["run"] == run.name])
        axes[-1, 0].set_xlabel("seconds since run start")
        more = len([r for r in runs if r.events]) - len(shown)
        title = "unbroken timeline" + (f" (first {len(shown)} runs; {more} more not drawn)" if more > 0 else "")
        fig.suptitle(title, fontsize=11)
        fig.legend(handles=_legend(), loc="upper right", fontsize=7, ncol=4)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        save_png(fig, path, dpi=110)
    finally:
        plt.close(fig)
    return path
