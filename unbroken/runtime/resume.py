"""`unbroken run --resume RUN_DIR`: what a stopped job needs to go on, and the checks first.

A run directory records how it was launched (launch.json: the script and its arguments)
next to its config (config.json). Resuming starts the same job again in the same
directory; its workers load the newest step whose tier-2 checkpoint is valid for every
rank (runtime/recovery.py `resume_from_tier2`) and train on from there, so the result is
the uninterrupted run's, bit for bit. The summary counts the steps recomputed.
"""
from __future__ import annotations

import json
from pathlib import Path

from unbroken.config import SHARDED, ConfigError, RunConfig
from unbroken.fsutil import atomic_write_json
from unbroken.runtime.jobkey import JobKeyError, read_job_key

LAUNCH_FILE = "launch.json"


def record_launch(run_dir: Path, script: tuple[str, ...]) -> None:
    atomic_write_json(run_dir / LAUNCH_FILE, {"script": list(script)})


def load_job(run_dir: Path) -> tuple[RunConfig, tuple[str, ...]]:
    """The stopped job's config and script; ConfigError (one line, with the fix) if it cannot resume."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.json); pass the directory a "
                          "stopped `unbroken run` wrote")
    try:
        cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
        script = tuple(json.loads((run_dir / LAUNCH_FILE).read_text())["script"])
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no {LAUNCH_FILE} (written by an older unbroken); "
                          "start a new run") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {run_dir}: its config.json or {LAUNCH_FILE} is unreadable ({e}); "
                          "start a new run") from None
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("ok"):
        raise ConfigError(f"--resume {run_dir}: that job already finished (summary.json says ok); "
                          "nothing to resume")
    if cfg.checkpoint_every <= 0:
        raise ConfigError(f"--resume {run_dir}: the job ran without tier-2 checkpoints (checkpoint_every = 0), "
                          "so there is nothing to resume from")
    _check_checkpoint(run_dir, cfg)
    return cfg, script


def _check_checkpoint(run_dir: Path, cfg: RunConfig) -> None:
    """Some step must be signed for every rank (a replica: rank 0's) before any process starts."""
    from unbroken.protect.tier2 import newest_signed_step  # torch's DCP: loaded only when needed

    try:
        key = read_job_key(run_dir)
    except JobKeyError as e:
        raise ConfigError(f"--resume {run_dir}: {e}") from None
    world = cfg.world_size if cfg.strategy in SHARDED else 1  # as runtime/persist.py writes them
    step = newest_signed_step(run_dir / "checkpoints", world_size=world, run_id=run_dir.name, key=key)
    if step is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint of every rank, signed by this job, is in "
                          f"{run_dir / 'checkpoints'}; start a new run")
