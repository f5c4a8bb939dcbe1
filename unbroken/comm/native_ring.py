"""The ring all-reduce's walk in C++ (ring_walk.cpp), for collectives whose flows are not read.

On 8 ranks sharing 2 cores a rank's next send in the Python walk waits for the interpreter as
well as for gloo; the compiled walk posts, waits and reduces with the GIL released. It is the
same walk: both execute patterns.ring_plan (the same receives in the same posting order, the
same sends, the same rank-order reduction with torch's own `add_`), so the bits are the same
(tested against the Python walk and the reference reduction, tests/unit/test_native_ring.py).

Building needs a C++ compiler and takes ~45 s, so it never happens inside a collective: `build()`
compiles into a per-source, per-torch cache directory (the bench and `unbroken run` call it
before starting ranks when `--collectives adaptive|static`), and `module()` only loads what was
built. Without it the Python walk runs; `UNBROKEN_NATIVE=0` turns the compiled walk off.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import torch

NAME = "unbroken_ring_walk"
SOURCE = Path(__file__).with_name("ring_walk.cpp")

_loaded: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("UNBROKEN_NATIVE", "1") != "0"


def build_dir() -> Path:
    """Where this source, built against this torch and Python, lives (UNBROKEN_NATIVE_DIR overrides the root)."""
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}|{sys.version}".encode()).hexdigest()[:16]
    root = os.environ.get("UNBROKEN_NATIVE_DIR") or Path.home() / ".cache" / "unbroken" / "native"
    return Path(root) / key


def _so() -> Path:
    return build_dir() / f"{NAME}.so"


def module():
    """The compiled walk if it was built (never builds), else None."""
    if not enabled():
        return None
    if "m" not in _loaded:
        path = _so()
        if not path.exists():
            return None
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
        m = importlib.util.module_from_spec(spec)
        loader.exec_module(m)
        _loaded["m"] = m
    return _loaded["m"]


def build(verbose: bool = False) -> str | None:
    """Compile the walk into build_dir() unless it is there; None when it is usable, else why not
    (one line: no compiler, a compile error). Safe to call from several processes at once (torch
    serializes builds of one directory with a lock file)."""
    if not enabled():
        return "UNBROKEN_NATIVE=0"
    if _so().exists():
        return None
    from torch.utils import cpp_extension
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(NAME, [str(SOURCE)], build_directory=str(d), extra_cflags=["-O3"], verbose=verbose)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler / ninja, a compile error
        return f"the compiled ring walk did not build ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
    return None if _so().exists() else f"the compiled ring walk did not appear in {d}"
