"""`unbroken rl train`: one RL post-training run (pre-train briefly, then GRPO with rollout and training
pools), its reward curve, length distribution, pools' idle fractions and moves printed and saved;
`register` adds it and `unbroken bench rl` to the CLI."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from unbroken.cli_error import fail
from unbroken.rl.config import METHODS, RLConfig
from unbroken.rl.errors import RLInputError

rl_app = typer.Typer(no_args_is_help=True, help="Elastic RL post-training: rollout and training pools that "
                                                "exchange processes at run time.")


@rl_app.callback()
def _group() -> None:
    """Elastic RL post-training (`unbroken rl train --help`)."""


@rl_app.command("train")
def train_cmd(method: str = typer.Option("dynamic", "--method", help=" | ".join(METHODS)),
              processes: int = typer.Option(4, "--processes", help="worker processes in all (1: one process, "
                                                                   "no pools)"),
              rollout: Optional[int] = typer.Option(None, "--rollout", help="rollout workers at the start "
                                                                           "(default: half)"),
              steps: int = typer.Option(30, "--steps"), lengths: str = typer.Option("longtail", "--lengths",
                                                                                    help="longtail | uniform"),
              staleness: int = typer.Option(1, "--staleness", help="0: on-policy; 1: sample with weights one "
                                                                   "update behind"),
              digits: int = typer.Option(2, "--digits"), prompts: int = typer.Option(8, "--prompts"),
              group: int = typer.Option(8, "--group", help="samples per prompt"),
              kl: float = typer.Option(0.0, "--kl", help="KL weight to the pre-trained reference (0 = off)"),
              reward: Optional[str] = typer.Option(None, "--reward", help="module:function(prompt, completion) "
                                                                          "-> number; default: the task's check"),
              kill_rollout_at: Optional[int] = typer.Option(None, "--kill-rollout-at",
                                                            help="SIGKILL a rollout worker at this step"),
              pretrain_steps: int = typer.Option(300, "--pretrain-steps", help="supervised warm-start steps"),
              seed: int = typer.Option(0, "--seed"),
              out: Path = typer.Option(Path("runs/rl"), "--out", help="directory for result.json, events, policy"),
              ) -> None:
    """Train; print the reward curve, samples/s, idle fractions and lengths; write OUT/result.json."""
    import torch

    from unbroken.fsutil import atomic_write_json
    from unbroken.rl import local, policy, run as rlrun, task
    from unbroken.rl.coordinator import RunError
    from unbroken.rl.metrics import length_stats
    from unbroken.rl.pool import Pool
    from unbroken.rl.warm import warm_state

    torch.set_num_threads(1)
    try:
        half = processes // 2 if rollout is None else rollout
        cfg = RLConfig(processes=processes, rollout=max(1, half) if rollout is None else rollout, steps=steps,
                       lengths=lengths, staleness=staleness, digits=digits, prompts=prompts, group=group, kl=kl,
                       pretrain_steps=pretrain_steps, seed=seed)
        if method not in METHODS:
            raise RLInputError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
        fn = task.load_reward(reward)
        init = warm_state(cfg, out)
        if processes == 1:
            curve, state = local.run_local(cfg, policy.load_state(init), fn, log=_print_step)
            result = {"method": "single-process", "curve": curve, "config": cfg.to_dict(),
                      "lengths": length_stats([n for c in curve for n in c.pop("lengths")])}
        else:
            with Pool(processes) as pool:
                result = rlrun.run(pool, cfg, method, init, out, rollout=cfg.rollout, reward=reward,
                                   kill_rollout_at=kill_rollout_at, progress=_print_step)
            result["config"] = cfg.to_dict()
    except RLInputError as e:
        fail(str(e))
    except RunError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    atomic_write_json(out / "result.json", result)
    _print_summary(result)
    typer.echo(f"wrote {out / 'result.json'}")


def _print_step(rec: dict) -> None:
    extra = f"  pools {rec['rollout']}r/{rec['train']}t gen {rec['gen']}" if "gen" in rec else ""
    typer.echo(f"step {rec['step']:4d}  reward {rec['reward']:.3f}  tokens {rec['tokens']}{extra}")


def _print_summary(r: dict) -> None:
    ls = r["lengths"]
    lengths = f"completion lengths: mean {ls['mean']:.1f} p50 {ls['p50']} p90 {ls['p90']} p99 {ls['p99']} max {ls['max']}"
    if "samples_per_s" not in r:
        typer.echo(lengths)
        return
    idle = "  ".join(f"{k} {v:.2f}" for k, v in r["idle"].items() if v is not None)
    typer.echo(f"{r['method']}: {r['samples_per_s']:.1f} samples/s, reward {r['reward_initial']:.3f} -> "
               f"{r['reward_final']:.3f}, staleness {r['staleness']}, idle fraction {idle}")
    typer.echo(f"{lengths}; moves {len(r['moves'])}, requeued groups {len(r['requeues'])}, "
               f"redone steps {len(r['redos'])}")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """`unbroken rl ...` and `unbroken bench rl` (cli.py calls this: one line there)."""
    from unbroken.bench.rl import rl as bench_rl

    app.add_typer(rl_app, name="rl")
    bench_app.command("rl")(bench_rl)
