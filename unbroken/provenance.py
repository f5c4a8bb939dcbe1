"""Where a result came from: the git commit (and whether the tree was dirty) of this checkout.

Every JSON a benchmark or the simulator writes records it, so that a number in the docs
can be traced to the code that produced it.
"""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(repo: Path | None = None) -> dict:
    """{"commit": HEAD sha, "dirty": uncommitted changes?} of the checkout this code runs from.

    Both are None when git is missing or the code is not in a git checkout (an installed wheel).
    """
    repo = Path(repo) if repo else Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return {"commit": None, "dirty": None}
    # results being written (bench/results/, a run's own config there) are not the code
    status = git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return {"commit": sha.strip(), "dirty": None if status is None else bool(status.strip())}
