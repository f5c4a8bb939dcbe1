"""The recovery timeline figure (PNG): step reached against wall time, one line per system, kills marked."""
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
