"""Entry point of every worker and shadow process: run the job's script as __main__.

    python -m unbroken.runtime.launch SCRIPT [ARGS...]
SCRIPT is a path to a .py file or a module name (the built-in job is
`unbroken.jobs.tiny_gpt`).
"""
from __future__ import annotations

import runpy
import sys
import traceback

from unbroken.runtime import crash
from unbroken.runtime.hard_exit import exit_without_teardown


def _seed_process() -> None:
    """Every process of the job starts with the same global generators (from --seed): a dataset
    or model the script builds from them at start is the same in a shadow as in the rank it
    replaces. (Per-step seeding takes over in the loop: runtime/determinism.py.)"""
    from unbroken import current_config
    from unbroken.runtime.determinism import seed_everything

    seed_everything(current_config().seed, 0, 0, 0)


def _own_process_groups() -> None:
    """The script's torch.distributed.init_process_group / destroy_process_group calls (a DDP
    script's set-up and tear-down) do nothing: unbroken builds and rebuilds the job's groups
    itself. A script that then uses the default group (DDP(model), dist.all_reduce) gets
    torch's own "Default process group has not been initialized" error."""
    import torch.distributed as dist

    def init_process_group(*args, **kwargs) -> None:
        return None

    def destroy_process_group(*args, **kwargs) -> None:
        return None

    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m unbroken.runtime.launch SCRIPT [ARGS...]")
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *args]
    code = 0
    try:
        _seed_process()
        _own_process_groups()
        if script.endswith(".py"):
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        crash.clean_exit()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except crash.Refused:  # the supervisor prints its message as the one-line error
        code = 1
    except BaseException as e:  # noqa: BLE001 - reported through the exit status, the log and the store
        traceback.print_exc()
        crash.record(e)
        code = 1
    exit_without_teardown(code)  # gloo groups kept alive on purpose would abort in their destructors


if __name__ == "__main__":
    main()
