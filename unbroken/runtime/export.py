"""`unbroken export`: a run's weights as a state_dict the user's unmodified model loads.

This module owns turning what a run directory holds back into `model.state_dict()` form:
the final weights (`weights.pt`, trusted only after its trained parameters match
`weights.sha256`) or a tier-2 checkpoint (every rank's shard of the flat parameters,
verified by `protect.tier2` with the run's key, RUN_DIR/job.key, cut into named parameters with `layout.pt`, plus the
untrained tensors and the decoded model buffers), and writing the result atomically as
one `torch.save` file (`pt`) or a `torch.distributed.checkpoint` directory (`dcp`).

    unbroken export RUN_DIR --to model.pt                       # the final weights
    unbroken export RUN_DIR --to ckpt/ --latest-checkpoint --format dcp
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer

from unbroken.cli_error import fail
from unbroken.parallel.buffers import decode_words
from unbroken.fsutil import fsync_dir
from unbroken.runtime.jobkey import JobKeyError, read_job_key

FORMATS = ("pt", "dcp")
_USE_WEIGHTS = "export the final weights instead (leave out --step/--latest-checkpoint)"
_USE_CHECKPOINT = "export a tier-2 checkpoint instead (--latest-checkpoint)"


class ExportError(ValueError):
    """A run directory cannot be exported as asked; the message names the file and the fix."""


# --- reading a run directory ---------------------------------------------------------------
def _run_dir(run_dir: str | os.PathLike) -> Path:
    path = Path(run_dir)
    if not path.is_dir():
        raise ExportError(f"no run directory {path}: pass the --run-dir of an unbroken run")
    return path


def _load(path: Path, what: str, fix: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ExportError(f"no {path.name} in {path.parent}: {what}; {fix}") from None
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise ExportError(f"cannot read {path} ({type(e).__name__}: {str(e)[:200]}): the file is "
                          f"damaged; {fix}") from None


def load_layout(run_dir: str | os.PathLike) -> dict:
    """layout.pt: how the flat parameters map onto the model's state_dict (Trainer._write_layout)."""
    path = _run_dir(run_dir) / "layout.pt"
    layout = _load(path, "the run never started or was made by an older unbroken",
                   "run the job again with this version of unbroken")
    if not isinstance(layout, dict) or layout.get("version") != 1:
        version = layout.get("version") if isinstance(layout, dict) else None
        raise ExportError(f"{path} has layout version {version!r}, this unbroken reads version 1; "
                          "export with the unbroken version that ran the job")
    return layout


def flat_sha256(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' float32 bytes, concatenated (Trainer.weights_sha256 of the flat parameters)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def state_dict_from_weights(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The final weights (`weights.pt`), after checking its trained parameters, in layout order,
    against `weights.sha256`."""
    path = _run_dir(run_dir)
    weights = _load(path / "weights.pt", "the run has not finished (rank 0 writes it at the end)",
                    _USE_CHECKPOINT)
    layout = load_layout(path)
    try:
        expected = (path / "weights.sha256").read_text().split()[0]
    except (OSError, IndexError):
        raise ExportError(f"no readable weights.sha256 in {path}: weights.pt cannot be verified; "
                          f"{_USE_CHECKPOINT}") from None
    if not isinstance(weights, dict):
        raise ExportError(f"{path / 'weights.pt'} holds a {type(weights).__name__}, not a state_dict; "
                          f"{_USE_CHECKPOINT}")
    trained = []
    for name, shape in layout["params"]:
        t = weights.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != torch.float32:
            raise ExportError(f"{path / 'weights.pt'} has no float32 tensor {name!r} of shape {tuple(shape)} "
                              f"that layout.pt lists; the file was replaced; {_USE_CHECKPOINT}")
        trained.append(t)
    got = flat_sha256(trained)
    if got != expected:
        raise ExportError(f"{path / 'weights.pt'} does not match weights.sha256 (its trained parameters hash to "
                          f"{got[:16]}..., the file says {expected[:16]}...): it is corrupted or was changed; "
                          f"restore it, or {_USE_CHECKPOINT}")
    return weights


# --- a tier-2 checkpoint ---------------------------------------------------------------------
def _manifest_run_id(ckdir: Path, steps: list[int], default: str) -> str:
    """The run id the checkpoints were written under (the run directory's name at the time)."""
    from unbroken.protect._tier2_files import manifest_path  # DCP: loaded only when needed
    for s in reversed(steps):
        try:
            return str(json.loads(manifest_path(ckdir, s, 0).read_bytes())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return default


def _pick_step(ckdir: Path, step: int | None, world: int, run_id: str, key: bytes, steps: list[int]) -> int:
    from unbroken.protect.tier2 import latest_valid_step  # DCP: loaded only when needed
    if step is None:
        found = latest_valid_step(ckdir, world_size=world, run_id=run_id, key=key)  # warns naming each bad step
        if found is None:
            raise ExportError(f"no valid checkpoint under {ckdir}: every step ({', '.join(map(str, steps))}) "
                              f"is incomplete or corrupted; {_USE_WEIGHTS}")
        return found
    if step not in steps:
        raise ExportError(f"no checkpoint of step {step} under {ckdir}; steps there: "
                          f"{', '.join(map(str, steps))} (pass one with --step, or --latest-checkpoint)")
    return step


def _read_shards(ckdir: Path, step: int, world: int, run_id: str, key: bytes,
                 shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's parameter shard, concatenated; rank 0's encoded buffers), signatures and checksums verified."""
    from unbroken.protect.tier2 import CheckpointError, load_checkpoint, manifest_path  # DCP: loaded only when needed
    shards, words = [], None
    for rank in range(world):
        try:
            tensors, _ = load_checkpoint(ckdir, step, rank=rank, world_size=world, run_id=run_id, key=key)
        except CheckpointError as e:
            raise ExportError(f"{e} (or export another step: --step N)") from None
        params = tensors.get("params")
        if params is None or tuple(params.shape) != (shard,) or "buffers" not in tensors:
            raise ExportError(f"{manifest_path(ckdir, step, rank)}: its tensors do not match layout.pt (a "
                              f"'params' shard of {shard} elements and 'buffers'): the checkpoint is from "
                              "another job; export the run it belongs to")
        shards.append(params)
        words = tensors["buffers"] if words is None else words
    return torch.cat(shards), words


def _checkpoints(run_dir: str | os.PathLike) -> tuple[Path, dict, Path, int, str, bytes, list[int]]:
    """(run dir, layout, checkpoint directory, ranks that wrote checkpoints, their run id, the run's
    key, steps there)."""
    from unbroken.protect.tier2 import list_steps  # DCP: loaded only when needed
    path = _run_dir(run_dir)
    layout = load_layout(path)
    ckdir = path / "checkpoints"
    world = layout["world_size"] if layout["sharded"] else 1  # ddp: rank 0 writes everything
    steps = list_steps(ckdir)
    if not steps:
        raise ExportError(f"no tier-2 checkpoint under {ckdir} (the run wrote none yet); {_USE_WEIGHTS}")
    try:
        key = read_job_key(path)  # the manifests are signed with it
    except JobKeyError as e:
        raise ExportError(f"{e}; or {_USE_WEIGHTS}") from None
    return path, layout, ckdir, world, _manifest_run_id(ckdir, steps, path.resolve().name), key, steps


def checkpoint_step(run_dir: str | os.PathLike, step: int | None = None) -> int:
    """`step` if the run has a checkpoint of it, else (None) the newest step whose files all verify."""
    _, _, ckdir, world, run_id, key, steps = _checkpoints(run_dir)
    return _pick_step(ckdir, step, world, run_id, key, steps)


def state_dict_from_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, torch.Tensor]:
    """The model's state_dict at tier-2 checkpoint `step` (default: the newest valid one)."""
    path, layout, ckdir, world, run_id, key, steps = _checkpoints(run_dir)
    step = _pick_step(ckdir, step, world, run_id, key, steps)
    flat, words = _read_shards(ckdir, step, world, run_id, key, layout["shard"])
    if layout.get("fsdp"):
        flat = _fsdp_flat(layout, flat, world)
    return assemble(layout, flat, words, path)


def _fsdp_flat(layout: dict, shards: torch.Tensor, world: int) -> torch.Tensor:
    """fsdp's shards (FSDP2's padded dim-0 slots, parallel/fsdp_layout.py) back in flat order."""
    from unbroken.parallel.fsdp_layout import FsdpLayout

    lay = FsdpLayout([torch.Size(shape) for _, shape in layout["params"]], [n for n, _ in layout["params"]], world)
    shard, parts = layout["shard"], []
    for i, s in enumerate(lay.slots):
        gathered = torch.cat([shards[r * shard + s.offset:r * shard + s.offset + s.size] for r in range(world)])
        parts.append(lay.full_from_slots(gathered, i))
    return torch.cat(parts)


def _buffers(layout: dict, words: torch.Tensor, where: Path) -> dict[str, torch.Tensor]:
    from unbroken.protect._tier2_files import parse_dtype  # DCP: loaded only when needed
    specs = [(parse_dtype(d, where / "layout.pt"), tuple(shape)) for _, d, shape in layout["buffers"]]
    nbytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs)
    if words.numel() != (nbytes + 1) // 2:
        raise ExportError(f"the checkpoint's buffers hold {words.numel()} words, layout.pt's buffers need "
                          f"{(nbytes + 1) // 2}: the checkpoint is from another job; export the run it belongs to")
    return {name: t.clone() for (name, _, _), t in zip(layout["buffers"], decode_words(words, specs))}


def assemble(layout: dict, flat: torch.Tensor, words: torch.Tensor, where: Path) -> dict[str, torch.Tensor]:
    """Cut the flat parameters into named tensors, add the untrained ones and the buffers, and
    return exactly layout['state_dict_keys'] (tied keys, layout['aliases'], share one tensor)."""
    if flat.numel() < layout["n"]:
        raise ExportError(f"the checkpoint holds {flat.numel()} parameters, layout.pt needs {layout['n']}: "
                          "it is from another job; export the run it belongs to")
    known: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape in layout["params"]:
        k = math.prod(shape)
        known[name] = flat[off:off + k].view(tuple(shape)).clone()
        off += k
    known.update(_buffers(layout, words, where))
    known.update({n: t.clone() for n, t in layout["fixed"].items() if n not in known})
    keys, aliases = layout["state_dict_keys"], layout.get("aliases", {})
    out = {k: known[aliases[k]] if aliases.get(k) in known else known.get(k) for k in keys}
    missing = [k for k, t in out.items() if t is None]
    if missing:
        why = "" if "aliases" in layout else " (tied weights? this run's layout.pt records no aliases)"
        raise ExportError(f"layout.pt in {where} does not say what state_dict key(s) {missing} hold{why}; "
                          f"{_USE_WEIGHTS}")
    return out


# --- writing ---------------------------------------------------------------------------------
def _save_pt(state_dict: dict, to: Path) -> None:
    if to.is_dir():
        raise ExportError(f"{to} is a directory: give a file path for --format pt, or use --format dcp")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_name(f".{to.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, to)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(to.parent)


def _save_dcp(state_dict: dict, to: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if to.exists() and not (to.is_dir() and (not any(to.iterdir()) or (to / ".metadata").is_file())):
        raise ExportError(f"{to} exists and is not a DCP checkpoint directory: refusing to replace it; "
                          "choose another --to, or remove it")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (to.with_name(f".{to.name}.{os.getpid()}.{s}") for s in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state_dict, checkpoint_id=tmp, no_dist=True)
        fsync_dir(tmp)
        if to.exists():
            os.rename(to, old)
        os.rename(tmp, to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(to.parent)


def save(state_dict: dict, to: str | os.PathLike, fmt: str = "pt") -> Path:
    """Write `state_dict` to `to`, atomically: one torch.save file (`pt`, for model.load_state_dict)
    or a DCP directory (`dcp`, for torch.distributed.checkpoint.load(model.state_dict(), ...))."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: use pt (one torch.save file) or dcp "
                          "(a torch.distributed.checkpoint directory)")
    to = Path(to)
    (_save_pt if fmt == "pt" else _save_dcp)(state_dict, to)
    return to


# --- the command -----------------------------------------------------------------------------
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (--run-dir of `unbroken run`).",
                                            metavar="RUN_DIR", show_default=False)],
    to: Annotated[Path, typer.Option("--to", help="Where to write: a file (pt) or a directory (dcp).",
                                     show_default=False)],
    step: Annotated[Optional[int], typer.Option(
        "--step", help="Export the tier-2 checkpoint of this step instead of the final weights.",
        show_default=False)] = None,
    latest_checkpoint: Annotated[bool, typer.Option(
        "--latest-checkpoint", help="Export the newest valid tier-2 checkpoint instead of the final weights.")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", help="pt: one torch.save file (model.load_state_dict); dcp: a torch.distributed.checkpoint "
                         "directory (dcp.load(model.state_dict(), checkpoint_id=...)).")] = "pt",
) -> None:
    """Write the final weights or a checkpoint as a state_dict the unmodified model loads."""
    from unbroken.protect.tier2 import CheckpointError  # DCP: loaded only when needed

    if fmt not in FORMATS:
        fail(f"unknown --format {fmt!r}: use pt (one torch.save file) or dcp (a torch.distributed.checkpoint "
             "directory)")
    if step is not None and latest_checkpoint:
        fail("pass either --step N or --latest-checkpoint, not both")
    if step is not None and step < 0:
        fail(f"--step must be a checkpointed step >= 0, got {step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if step is not None or latest_checkpoint:
                step = checkpoint_step(run_dir, step)
                sd, source = state_dict_from_checkpoint(run_dir, step), f"the checkpoint of step {step}"
            else:
                sd, source = state_dict_from_weights(run_dir), "the final weights"
            save(sd, to, fmt)
        except (ExportError, CheckpointError) as e:
            fail(str(e))
        except OSError as e:
            fail(f"cannot export {run_dir} to {to}: {e}; check the paths and permissions, or choose another --to")
    for w in caught:
        if "skipping checkpoint step" in str(w.message):
            typer.secho(f"warning: {w.message}", err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {to} ({fmt}, {len(sd)} tensors) from {source} of {run_dir}")
