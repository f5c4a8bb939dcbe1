"""`unbroken export` of a real job: final weights and the final step's checkpoint, as .pt and as DCP,
load into a freshly built unmodified model, and the checkpoint export equals weights.pt bitwise."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unbroken.config import ModelConfig
from unbroken.models import VOCAB_SIZE
from unbroken.models.gpt import build_model

from .conftest import run_job


def _export(run_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unbroken.cli", "export", str(run_dir), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _fresh():
    return build_model(ModelConfig(n_layer=1, n_embd=32), VOCAB_SIZE, seed=123)  # not the run's seed


def _same(a: dict, b: dict) -> bool:
    """Same keys, and every tensor bitwise equal."""
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.mark.timeout(300)
def test_export_weights_and_checkpoint_into_the_unmodified_model(tmp_path):
    run = tmp_path / "r"
    job = run_job(run, "--world-size", "4", "--steps", "6", "--checkpoint-every", "3",
                  "--n-layer", "1", "--n-embd", "32")
    assert job["ok"] and job["steps"] == 6
    final = torch.load(run / "weights.pt")
    outs = {"w.pt": [], "c.pt": ["--step", "6"], "w.dcp": ["--format", "dcp"],
            "c.dcp": ["--latest-checkpoint", "--format", "dcp"]}
    for name, args in outs.items():
        p = _export(run, "--to", tmp_path / name, *args)
        assert p.returncode == 0, p.stderr
    assert _same(torch.load(tmp_path / "c.pt"), final)  # the step-6 checkpoint is the final weights
    for name in ("w.pt", "c.pt"):
        model = _fresh()
        assert not _same(model.state_dict(), final)
        model.load_state_dict(torch.load(tmp_path / name, weights_only=True), strict=True)
        assert _same(model.state_dict(), final), name
    for name in ("w.dcp", "c.dcp"):
        model = _fresh()
        sd = model.state_dict()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=tmp_path / name)
        assert _same(model.state_dict(), final), name
    bad = _export(run, "--to", tmp_path / "x.pt", "--step", "4")
    assert bad.returncode == 2 and "no checkpoint of step 4" in bad.stderr and "Traceback" not in bad.stderr
