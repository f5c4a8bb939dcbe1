"""Figures: matplotlib on the Agg backend, and PNGs written atomically."""
from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from unbroken.fsutil import atomic_write_bytes  # noqa: E402

__all__ = ["plt", "save_png"]


def save_png(fig, path: str | Path, *, dpi: int | None = None) -> None:
    """Render `fig` as PNG and write it atomically to `path` (the caller closes the figure)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **({"dpi": dpi} if dpi else {}))
    atomic_write_bytes(path, buf.getvalue())
