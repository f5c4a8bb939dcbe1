"""The ETTR-versus-cluster-size figure (PNG), one line per policy with its 95% band."""
from __future__ import annotations

from pathlib import Path

from unbroken.figures import plt, save_png
from unbroken.sim.montecarlo import Summary


def plot_ettr(curves: dict[str, list[Summary]], path: str | Path, *, title: str) -> None:
    """Write the figure atomically to `path` (parents created)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    try:
        for name, rows in curves.items():
            x = [r.gpus for r in rows]
            ax.plot(x, [100 * r.ettr for r in rows], marker="o", label=name)
            ax.fill_between(x, [100 * r.ettr_low for r in rows], [100 * r.ettr_high for r in rows], alpha=0.2)
        ax.set_xscale("log", base=2)
        sizes = sorted({r.gpus for rows in curves.values() for r in rows})
        ax.set_xticks(sizes, [f"{g / 1024:g}k" if g >= 1024 else str(g) for g in sizes])
        ax.minorticks_off()
        ax.set_xlabel("GPUs")
        ax.set_ylabel("net ETTR (productive / wall, net of overhead), %")
        ax.axhline(95, color="grey", linestyle=":", linewidth=1)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(loc="lower left")
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)
