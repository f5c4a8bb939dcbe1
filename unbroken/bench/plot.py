"""Benchmark figures (PNG): the recovery timeline (step reached against wall time, kills marked) and
the overhead ratios to native PyTorch with their confidence intervals."""
from __future__ import annotations

from pathlib import Path

from unbroken.figures import plt, save_png


def plot_timelines(series: dict[str, dict], path: str | Path, *, title: str) -> None:
    """series: name -> {"t": [s], "step": [n], "kills_t": [s]}; written atomically to `path`."""
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        for i, (name, s) in enumerate(series.items()):
            color = f"C{i}"
            ax.step(s["t"], s["step"], where="post", color=color, label=name)
            for j, kt in enumerate(s["kills_t"]):
                ax.axvline(kt, color=color, linestyle="--", linewidth=0.8, alpha=0.7,
                           label=f"{name}: SIGKILL" if j == 0 else None)
        ax.set_xlabel("wall time since launch, s")
        ax.set_ylabel("step completed")
        ax.grid(True, alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)


def plot_overhead(res: dict, path: str | Path) -> None:
    """overhead.json as a figure: per strategy, ratio to native with its 95% CI, for off and default, by world."""
    strategies = list(res["ratio"])
    fig, axes = plt.subplots(1, max(1, len(strategies)), figsize=(4.2 * max(1, len(strategies)), 3.8), dpi=120,
                             squeeze=False)
    try:
        for ax, s in zip(axes[0], strategies):
            worlds = list(res["ratio"][s])
            for i, (name, rk, ck) in enumerate((("off", "ratio_off", "ci95_off"), ("default", "ratio", "ci95"))):
                xs = [j + (i - 0.5) * 0.2 for j in range(len(worlds))]
                ys = [res[rk][s][w] for w in worlds]
                err = [[y - res[ck][s][w][0] for y, w in zip(ys, worlds)],
                       [res[ck][s][w][1] - y for y, w in zip(ys, worlds)]]
                ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=4, color=f"C{i}", label=f"unbroken {name}")
            ax.axhline(res["goal"], color="C3", linestyle="--", linewidth=1, label=f"goal {res['goal']}")
            ax.axhline(1.0, color="0.5", linestyle=":", linewidth=0.8)
            ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
            ax.set_xlim(-0.6, len(worlds) - 0.4)
            ax.set_title(f"{s} vs {res['peer'][s]['peer']}", fontsize=8)
            ax.set_ylabel("tokens/s ratio to native (mean step)")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(loc="lower left", fontsize=7)
        fig.suptitle(f"failure-free overhead, {res['steps']} steps x {res['rounds']} rounds, 95% CI", fontsize=9)
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)
