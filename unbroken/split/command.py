"""`unbroken split train`: one split-learning method on a non-IID split, printed and saved;
`register` adds it and `unbroken bench split` to the CLI."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from unbroken.cli_error import fail
from unbroken.split.config import METHODS, SplitConfig
from unbroken.split.errors import SplitInputError

split_app = typer.Typer(no_args_is_help=True, help="Clustered parallel split learning (GCPSL) and its baselines.")


def _assignment(path: Path | None):
    if path is None:
        return None
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SplitInputError(f"--assignment {path}: cannot read a JSON list of cluster ids ({e}); give a file "
                              "like [0, 1, 0, 2, ...], one id per client") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SplitInputError(f"--assignment {path} must hold a JSON list of integer cluster ids, one per client")
    return ids


@split_app.command("train")
def train_cmd(method: str = typer.Option("gcpsl-label", "--method", help=" | ".join(METHODS)),
              dataset: str = typer.Option("fashion-mnist", "--dataset", help="fashion-mnist | cifar10 | digits"),
              data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="dataset directory (cifar10: "
                                                                                "cifar-10-batches-py)"),
              clients: int = typer.Option(256, "--clients"), clusters: int = typer.Option(4, "--clusters"),
              alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet label skew (smaller = more skewed)"),
              size_sigma: float = typer.Option(1.0, "--size-sigma", help="log-normal client size skew"),
              merge_every: int = typer.Option(32, "--merge-every", help="local steps between cluster merges"),
              batch: int = typer.Option(64, "--batch", help="global-sampling batch per worker step"),
              epochs: float = typer.Option(2.0, "--epochs"), lr: float = typer.Option(0.02, "--lr"),
              p_drop: float = typer.Option(0.0, "--p-drop", help="a client's chance to drop out of a round"),
              seed: int = typer.Option(0, "--seed"),
              assignment: Optional[Path] = typer.Option(None, "--assignment", help="JSON list: cluster id per client"),
              inject: Optional[List[str]] = typer.Option(None, "--inject", help="GCPSL: a fault for `unbroken run`"),
              out: Path = typer.Option(Path("runs/split"), "--out", help="directory for result.json (and the job)"),
              ) -> None:
    """Train one method; print final accuracy, training time and participation; write OUT/METHOD.json."""
    from unbroken.split import data, train
    from unbroken.split.launch import JobFailed, run_gcpsl
    from unbroken.split.participation import account
    from unbroken.split.plan import rounds

    try:
        if method not in METHODS:
            raise SplitInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if inject and not method.startswith("gcpsl"):
            raise SplitInputError("--inject needs a GCPSL method (its cluster workers are the processes to fault)")
        cfg = SplitConfig(dataset=dataset, data_dir=None if data_dir is None else str(data_dir), clients=clients,
                          clusters=clusters, alpha=alpha, size_sigma=size_sigma, merge_every=merge_every,
                          batch=batch, epochs=epochs, lr=lr, p_drop=p_drop, seed=seed)
        split = data.load(cfg.dataset, cfg.data_dir)
        fed = train.federation(split, cfg, method, _assignment(assignment))
        part = account(rounds(method, fed, cfg), fed, cfg.samples_per_round)
    except SplitInputError as e:
        fail(str(e))
    if method.startswith("gcpsl"):
        try:
            res = run_gcpsl(cfg, method, out / method, inject=tuple(inject or ()), cluster_of=fed.cluster_of)
        except JobFailed as e:
            if e.rc == 2:  # the runtime refused the input (a fault spec that can never fire, ...)
                fail(str(e))
            typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
            raise typer.Exit(1) from None
        curve, extra = res.curve, {"recoveries": len(res.summary.get("recoveries", [])), "job_wall_s": res.wall_s}
    else:
        import torch

        torch.set_num_threads(1)  # one worker's share, as each cluster worker runs
        curve, _ = train.run(method, split, cfg, fed)
        extra = {}
    result = {"method": method, "config": cfg.to_dict(), "final_accuracy": curve.final,
              "train_s": curve.points[-1][1], "curve": curve.points, "participation": part, **extra}
    from unbroken.fsutil import atomic_write_json

    atomic_write_json(out / f"{method}.json", result)
    typer.echo(f"{method}: final accuracy {curve.final:.4f} after {result['train_s']:.1f} s of training; "
               f"participation clients {part['clients']:.3f} samples {part['samples']:.3f}; dropped client-rounds "
               f"{part['dropped_client_rounds']}" + (f"; recoveries {extra['recoveries']}" if extra else ""))
    typer.echo(f"wrote {out / f'{method}.json'}")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """`unbroken split ...` and `unbroken bench split` (cli.py calls this: one line there)."""
    from unbroken.bench.split import split as bench_split

    app.add_typer(split_app, name="split")
    bench_app.command("split")(bench_split)
