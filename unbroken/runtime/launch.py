"""Entry point of every worker and shadow process: run the job's script as __main__.

    python -m unbroken.runtime.launch SCRIPT [ARGS...]
SCRIPT is a path to a .py file or a module name (the built-in job is
`unbroken.jobs.tiny_gpt`).
"""
from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m unbroken.runtime.launch SCRIPT [ARGS...]")
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *args]
    if script.endswith(".py"):
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
