"""GCPSL's cluster worker, a script for `unbroken run --world-size CLUSTERS`: rank c runs
cluster c's GPSL round from the merged weights, and the merge (the average of every
cluster's client and server segments) is the Trainer's step, so the merged segments are
protected by the runtime. A worker killed mid-round is replaced by a shadow that gets the
merged weights from its peers and redoes the round: the round's data is a function of
(seed, round, cluster) and the local round is recomputed from the merged weights.

    unbroken run --world-size 4 --strategy ddp --steps R unbroken/split/job.py --spec SPEC.json
"""
from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path

import torch

import unbroken
from unbroken.fsutil import atomic_write_bytes, atomic_write_json
from unbroken.split import data, train
from unbroken.split.config import SplitConfig
from unbroken.split.model import accuracy
from unbroken.split.plan import rounds


class RoundStream:
    """Round t's batches for one cluster; replays the schedule from round 1 when asked for an
    earlier round (a redo, a process that joined at round t), so it is a function of t alone."""

    def __init__(self, method: str, fed, cfg: SplitConfig, cluster: int) -> None:
        self.args, self.cluster = (method, fed, cfg), cluster
        self._it, self._last = rounds(*self.args), None

    def batches(self, t: int):
        if self._last is not None and self._last.index > t:
            self._it, self._last = rounds(*self.args), None
        while self._last is None or self._last.index < t:
            self._last = next(self._it)
        return self._last.batches[self.cluster]


def merge_loss(merged: torch.nn.Module, local: torch.nn.Module) -> torch.Tensor:
    """A loss whose gradient is merged - local: averaged over the ranks by the Trainer and
    applied by SGD(lr=1), the merged weights become the clusters' mean."""
    terms = [(p * (p.detach() - q.detach())).sum() for p, q in zip(merged.parameters(), local.parameters())]
    return torch.stack(terms).sum()


class CurveLog:
    """Rank 0's validation curve, rewritten atomically each round; a rank 0 that replaces a lost
    one continues it (wall-clock time from the first round's start, evaluation excluded)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        old = json.loads(path.read_text()) if path.exists() else {}
        self.t0, self.eval_s, self.points = old.get("t0"), old.get("eval_s", 0.0), old.get("points", [])

    def add(self, t: int, model: torch.nn.Module, split: data.Split) -> None:
        t1 = time.time()
        acc = accuracy(model, split.x_val, split.y_val)
        self.points = [p for p in self.points if p[0] < t] + [(t, t1 - self.t0 - self.eval_s, acc)]
        self.eval_s += time.time() - t1
        atomic_write_json(self.path, {"t0": self.t0, "eval_s": self.eval_s, "points": self.points})


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cfg, method, out = SplitConfig.from_dict(spec["config"]), spec["method"], Path(spec["out"])
    split = data.load(cfg.dataset, cfg.data_dir)
    fed = train.federation(split, cfg, method, spec.get("cluster_of"))
    model = train.new_model(split, cfg)
    trainer = unbroken.Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0))
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != cfg.clusters:
        raise SystemExit(f"world size {os.environ['WORLD_SIZE']} != {cfg.clusters} clusters: one rank per cluster")
    stream = RoundStream(method, fed, cfg, rank)
    log = CurveLog(out / "curve.json") if rank == 0 else None
    for t in trainer.steps(cfg.rounds(len(fed.labels))):
        if log is not None and log.t0 is None:
            log.t0 = time.time()
        batches = stream.batches(t)
        trainer.step(lambda: merge_loss(trainer.module, train.local_round(trainer.module.state_dict(), batches,
                                                                          split, cfg)))
        if log is not None:
            log.add(t, trainer.module, split)
    if rank == 0:
        buf = io.BytesIO()
        torch.save(trainer.module.state_dict(), buf)
        atomic_write_bytes(out / "final.pt", buf.getvalue())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON: config, method, out, optional cluster_of")
    main(ap.parse_args().spec)
