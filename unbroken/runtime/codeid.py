"""What code a node runs: unbroken's version and source digest, and the training script's digest.

Node 0 publishes its identity before admitting anyone; a node whose identity differs refuses
to join (one line naming what differs and the fix), so two nodes never train with different
code and diverge silently. Paths do not count (the same script may live elsewhere on each
machine): contents do.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import unbroken


@functools.lru_cache(maxsize=None)
def source_digest(root: Path = Path(unbroken.__file__).parent) -> str:
    """sha256 over every .py file of the package, by relative path and content."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def script_digest(script: tuple[str, ...]) -> str:
    """A file's content digest; a module name (`unbroken.jobs.tiny_gpt`) stands for itself."""
    first = script[0] if script else ""
    path = Path(first)
    body = path.read_bytes() if first.endswith(".py") and path.is_file() else first.encode()
    return hashlib.sha256(body).hexdigest()


def identity(script: tuple[str, ...]) -> dict[str, str]:
    return {"unbroken": unbroken.__version__, "source": source_digest(), "script": script_digest(script),
            "script_name": Path(script[0]).name if script else ""}


def mismatch(mine: dict[str, str], node0: dict[str, str], node: int) -> str | None:
    """None when node `node` runs node 0's code; else what differs and how to fix it."""
    if (mine["unbroken"], mine["source"]) != (node0["unbroken"], node0["source"]):
        return (f"node {node} runs unbroken {mine['unbroken']} (source {mine['source'][:12]}), node 0 runs "
                f"{node0['unbroken']} (source {node0['source'][:12]}): install the same unbroken on every node")
    if mine["script"] != node0["script"]:
        return (f"node {node}'s training script {mine['script_name']} (sha256 {mine['script'][:12]}) differs from "
                f"node 0's {node0['script_name']} ({node0['script'][:12]}): run the same script on every node")
    return None
