"""unbroken export: checkpoints (zero1 shards with padding, ddp) and final weights back into the
user's unmodified model, bitwise; buffers, frozen and tied parameters; every bad input named."""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import typer
from typer.testing import CliRunner

from unbroken.parallel.buffers import ModelBuffers, decode_words
from unbroken.parallel.optim import ChunkOptimizer
from unbroken.parallel.strategy import OwnedState
from unbroken.protect.tier2 import CheckpointWriter
from unbroken.runtime.adopt import trained_parameters
from unbroken.runtime.adopt import aliases_of
from unbroken.runtime.jobkey import ensure_job_key
from unbroken.runtime.export import (ExportError, checkpoint_step, export, flat_sha256, save,
                                     state_dict_from_checkpoint, state_dict_from_weights)
from unbroken.runtime.worker import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
_app = typer.Typer()
_app.command()(export)


class Net(nn.Module):
    """BatchNorm buffers (float32 + int64 counter), a non-persistent buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 5)
        self.bn = nn.BatchNorm1d(5)
        self.frozen = nn.Linear(5, 3)
        self.frozen.weight.requires_grad_(False)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        # 3 float16 = 6 bytes: the BatchNorm buffers after it start unaligned in the encoded words
        self.register_buffer("f16", torch.zeros(3, dtype=torch.float16))


class TiedLM(nn.Module):
    """nanoGPT-style tied head: both keys appear in state_dict, named_parameters() keeps only wte."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.wte.weight = self.lm_head.weight


def _trained(model: nn.Module, seed: int) -> nn.Module:
    """Pretend training happened: new parameter values, BatchNorm statistics moved."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        if hasattr(model, "bn"):
            model.bn(torch.randn(9, 5, generator=g))
            model.f16.copy_(torch.randn(3, generator=g))
    return model


def _fake_run(run_dir: Path, model: nn.Module, *, strategy: str = "zero1", world: int = 4,
              steps: tuple[int, ...] = (4,), lr_groups=None, aliases: bool = True) -> dict:
    """A run directory as a job leaves it: layout.pt (written by the Trainer's own code), one
    tier-2 checkpoint per step and rank (the real writer), weights.pt + weights.sha256."""
    opt = torch.optim.AdamW(lr_groups(model) if lr_groups else [p for p in model.parameters() if p.requires_grad])
    named, group_of = trained_parameters(model, opt)
    buffers = ModelBuffers(model)
    ranks = range(world) if strategy == "zero1" else range(1)
    owned = [OwnedState(named, group_of, ChunkOptimizer(opt), buffers, strategy=strategy, rank=r, world=world,
                        group_size=1, chunk_elems=16) for r in ranks]
    trainer = SimpleNamespace(owned=owned[-1], named=named, model=model, world_size=world,
                              ctx=SimpleNamespace(run_dir=run_dir))
    Trainer._write_layout(trainer)
    layout = torch.load(run_dir / "layout.pt")
    assert layout["aliases"] == aliases_of(model)  # the Trainer records the tied names
    if not aliases:  # a layout.pt of a version that did not record them
        del layout["aliases"]
    torch.save(layout, run_dir / "layout.pt")
    key = ensure_job_key(run_dir)  # as the supervisor does before any worker starts
    for o, r in zip(owned, ranks):
        for name, t in o.opt_state.items():
            t.normal_()  # optimizer state rides along; export ignores it
        with CheckpointWriter(run_dir / "checkpoints", rank=r, world_size=len(ranks), run_id=run_dir.name,
                              strategy=strategy, key=key, keep=5) as w:
            for step in steps:
                w.save_async(step, 0, o.tensors(), {"strategy": strategy})
    flat = owned[-1].flat
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "weights.pt")
    digest = hashlib.sha256(flat.params[:flat.n].numpy().tobytes()).hexdigest()  # Trainer.weights_sha256
    (run_dir / "weights.sha256").write_text(f"{digest}  parameters\n")
    return layout


def _bitwise_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def _fresh_loads(model_cls, sd: dict) -> nn.Module:
    fresh = model_cls()
    fresh.load_state_dict(sd, strict=True)
    return fresh


# --------------------------------------------------------------------------- checkpoints


def test_zero1_world4_with_padding_buffers_and_frozen_parameter(tmp_path):
    model = _trained(Net(), 1)
    layout = _fake_run(tmp_path, model)
    assert layout["sharded"] and layout["shard"] * 4 > layout["n"]  # the last shard is padded
    assert "frozen.weight" in layout["fixed"] and "scratch" not in layout["state_dict_keys"]
    sd = state_dict_from_checkpoint(tmp_path)
    assert _bitwise_equal(sd, model.state_dict())
    fresh = _fresh_loads(Net, sd)
    assert fresh.bn.num_batches_tracked.item() == 1 and torch.equal(fresh.bn.running_var, model.bn.running_var)


def test_ddp_has_one_checkpoint_holding_everything(tmp_path):
    model = _trained(Net(), 2)
    layout = _fake_run(tmp_path, model, strategy="ddp", world=3)
    assert not layout["sharded"]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000004").glob("*.json")) == ["rank0.json"]
    assert _bitwise_equal(state_dict_from_checkpoint(tmp_path, 4), model.state_dict())


def test_param_groups_and_a_parameter_outside_the_optimizer(tmp_path):
    model = _trained(Net(), 3)
    groups = lambda m: [{"params": [m.fc.weight], "weight_decay": 0.1}, {"params": [m.bn.weight]}]  # noqa: E731
    layout = _fake_run(tmp_path, model, world=2, lr_groups=groups)
    assert {"fc.bias", "bn.bias", "frozen.weight", "frozen.bias"} <= set(layout["fixed"])
    assert _bitwise_equal(state_dict_from_checkpoint(tmp_path), model.state_dict())


def test_tied_weights_share_one_tensor_and_load_tied(tmp_path):
    model = _trained(TiedLM(), 4)
    assert aliases_of(model) == {"lm_head.weight": "wte.weight"}
    _fake_run(tmp_path, model, world=4)
    sd = state_dict_from_checkpoint(tmp_path)
    assert list(sd) == list(model.state_dict()) and sd["lm_head.weight"] is sd["wte.weight"]
    assert _bitwise_equal(sd, model.state_dict())
    fresh = _fresh_loads(TiedLM, sd)
    assert fresh.lm_head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, model.wte.weight)


def test_tied_weights_without_aliases_in_layout_are_named(tmp_path):
    _fake_run(tmp_path, _trained(TiedLM(), 5), aliases=False)
    with pytest.raises(ExportError, match=r"\['lm_head.weight'\].*records no aliases.*final weights"):
        state_dict_from_checkpoint(tmp_path)


def test_newest_valid_step_by_default_and_corrupt_steps_skipped(tmp_path):
    model = _trained(Net(), 6)
    _fake_run(tmp_path, model, world=2, steps=(2, 4))
    assert checkpoint_step(tmp_path) == 4
    (tmp_path / "checkpoints" / "step_00000004" / "rank1.json").unlink()  # rank 1 never finished step 4
    with pytest.warns(UserWarning, match="skipping checkpoint step 4"):
        assert checkpoint_step(tmp_path) == 2
    assert _bitwise_equal(state_dict_from_checkpoint(tmp_path, 2), model.state_dict())
    with pytest.raises(ExportError, match="rank1.json: missing.*--step N"):
        state_dict_from_checkpoint(tmp_path, 4)


def test_checkpoint_bad_input_is_named(tmp_path):
    _fake_run(tmp_path, _trained(Net(), 7), world=2, steps=(3,))
    with pytest.raises(ExportError, match="no checkpoint of step 5 .* steps there: 3"):
        state_dict_from_checkpoint(tmp_path, 5)
    data = next((tmp_path / "checkpoints" / "step_00000003").glob("rank0.*.dcp")) / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-20] ^= 1
    data.write_bytes(bytes(blob))
    with pytest.warns(UserWarning), pytest.raises(ExportError, match="no valid checkpoint .*final weights"):
        state_dict_from_checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "layout.pt").write_bytes((tmp_path / "layout.pt").read_bytes())
    with pytest.raises(ExportError, match="no tier-2 checkpoint"):
        state_dict_from_checkpoint(empty)
    with pytest.raises(ExportError, match="no layout.pt"):
        state_dict_from_checkpoint(tmp_path / "checkpoints")
    with pytest.raises(ExportError, match="no run directory"):
        state_dict_from_checkpoint(tmp_path / "nope")


# --------------------------------------------------------------------------- final weights


def test_weights_verified_against_their_checksum(tmp_path):
    model = _trained(Net(), 8)
    _fake_run(tmp_path, model, world=4)
    sd = state_dict_from_weights(tmp_path)
    assert _bitwise_equal(sd, model.state_dict())
    assert flat_sha256([sd[n] for n in ("fc.weight", "fc.bias", "bn.weight", "bn.bias", "frozen.bias")]) == \
        (tmp_path / "weights.sha256").read_text().split()[0]
    sd["fc.bias"][0] += 1.0
    torch.save(sd, tmp_path / "weights.pt")
    with pytest.raises(ExportError, match=r"weights.pt does not match weights.sha256.*--latest-checkpoint"):
        state_dict_from_weights(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"not a torch file")
    with pytest.raises(ExportError, match="cannot read .*weights.pt.*damaged"):
        state_dict_from_weights(tmp_path)
    (tmp_path / "weights.pt").unlink()
    with pytest.raises(ExportError, match="no weights.pt .*not finished.*--latest-checkpoint"):
        state_dict_from_weights(tmp_path)


# --------------------------------------------------------------------------- writing


def test_save_pt_and_dcp_load_into_the_unmodified_model(tmp_path):
    model = _trained(TiedLM(), 9)
    sd = copy.deepcopy(model.state_dict())
    fresh = _fresh_loads(TiedLM, torch.load(save(sd, tmp_path / "sub" / "m.pt", "pt")))
    assert _bitwise_equal(fresh.state_dict(), sd) and not list(tmp_path.glob("sub/.*"))
    for _ in range(2):  # the second save replaces the first DCP directory
        save(sd, tmp_path / "m.dcp", "dcp")
    target = TiedLM()
    into = target.state_dict()
    dcp.load(into, checkpoint_id=tmp_path / "m.dcp")
    assert _bitwise_equal(target.state_dict(), sd) and target.lm_head.weight is target.wte.weight
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(ExportError, match="unknown format 'zip'"):
        save(sd, tmp_path / "x", "zip")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a DCP checkpoint directory: refusing"):
        save(sd, tmp_path / "mine", "dcp")
    with pytest.raises(ExportError, match="is a directory"):
        save(sd, tmp_path / "mine", "pt")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_decode_words_is_what_model_buffers_decode():
    model = _trained(Net(), 10)
    mb = ModelBuffers(model)
    specs = [(b.dtype, tuple(b.shape)) for b in mb.buffers]
    assert specs[2] == (torch.float32, (5,)) and (2 * 4 + 3 * 2) % 4 != 0  # bn.running_mean: unaligned
    got = decode_words(mb.committed, specs)
    assert all(torch.equal(a, b) for a, b in zip(got, mb.buffers))
    with torch.no_grad():
        for b in mb.buffers:
            b.zero_()
    mb.restore()
    assert all(torch.equal(a, b) for a, b in zip(got, mb.buffers))


# --------------------------------------------------------------------------- the command


def _cli(*args) -> object:
    return CliRunner().invoke(_app, [str(a) for a in args])


def test_cli_exports_weights_and_checkpoints(tmp_path):
    model = _trained(Net(), 11)
    _fake_run(tmp_path / "run", model, world=2, steps=(2, 4))
    res = _cli(tmp_path / "run", "--to", tmp_path / "w.pt")
    assert res.exit_code == 0 and "from the final weights" in res.output
    res = _cli(tmp_path / "run", "--to", tmp_path / "c", "--latest-checkpoint", "--format", "dcp")
    assert res.exit_code == 0 and "step 4" in res.output and (tmp_path / "c" / ".metadata").is_file()
    res = _cli(tmp_path / "run", "--to", tmp_path / "c2.pt", "--step", "2")
    assert res.exit_code == 0, res.output
    assert _bitwise_equal(torch.load(tmp_path / "c2.pt"), torch.load(tmp_path / "w.pt"))


@pytest.mark.parametrize("args,needle", [
    (["--to", "{t}/o.pt", "--format", "zip"], "unknown --format 'zip'"),
    (["--to", "{t}/o.pt", "--step", "2", "--latest-checkpoint"], "either --step N or --latest-checkpoint"),
    (["--to", "{t}/o.pt", "--step", "9"], "no checkpoint of step 9"),
    (["--to", "{t}/o.pt", "--run", "nope"], "No such option"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    _fake_run(tmp_path / "run", _trained(Net(), 12), world=2, steps=(2,))
    res = _cli(tmp_path / "run", *[a.format(t=tmp_path) for a in args])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o.pt").exists()


def test_cli_missing_weights_and_bad_checksum(tmp_path):
    _fake_run(tmp_path / "run", _trained(Net(), 13), world=2)
    (tmp_path / "run" / "weights.sha256").write_text("0" * 64 + "  parameters\n")
    res = _cli(tmp_path / "run", "--to", tmp_path / "o.pt")
    assert res.exit_code == 2 and "does not match weights.sha256" in res.output
    (tmp_path / "run" / "weights.pt").unlink()
    res = _cli(tmp_path / "run", "--to", tmp_path / "o.pt")
    assert res.exit_code == 2 and "no weights.pt" in res.output and len(res.output.strip().splitlines()) == 1
    res = _cli(tmp_path / "nope", "--to", tmp_path / "o.pt")
    assert res.exit_code == 2 and "no run directory" in res.output


def test_cli_missing_or_unsafe_job_key_is_one_line_exit_2(tmp_path):
    """Checkpoints are trusted only under the run's key: no key (or one others can read), no export."""
    run = tmp_path / "run"
    _fake_run(run, _trained(Net(), 14), world=2, steps=(2,))
    (run / "job.key").chmod(0o644)
    res = _cli(run, "--to", tmp_path / "o.pt", "--latest-checkpoint")
    assert res.exit_code == 2 and "readable by other users" in res.output and "chmod 600" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    (run / "job.key").unlink()
    res = _cli(run, "--to", tmp_path / "o.pt", "--step", "2")
    assert res.exit_code == 2 and "job.key is missing" in res.output and "final weights instead" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "o.pt").exists()
    ensure_job_key(run)  # another key: every manifest's signature fails
    res = _cli(run, "--to", tmp_path / "o.pt", "--step", "2")
    assert res.exit_code == 2 and "manifest signature mismatch" in res.output
    assert _cli(run, "--to", tmp_path / "w.pt").exit_code == 0  # the final weights need no key
