"""Tier-2 manifests signed with the job key (HMAC-SHA256), and private files (0600) and dirs (0700)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.protect.tier2 import (CheckpointError, CheckpointWriter, latest_valid_step, load_checkpoint,
                                    newest_own_valid_step, verify_step)

RUN = "run-a"
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"params": torch.randn(64, generator=g), "exp_avg": torch.randn(8, 8, generator=g)}


def _save(directory: Path, steps=(1,), *, world_size: int = 1, key: bytes = KEY, keep: int = 5) -> None:
    for rank in range(world_size):
        with CheckpointWriter(directory, rank=rank, world_size=world_size, run_id=RUN, strategy="zero1",
                              key=key, keep=keep) as w:
            for step in steps:
                w.save_async(step, 0, _state(step * 10 + rank))


def _manifest(directory: Path, step: int, rank: int = 0) -> Path:
    return directory / f"step_{step:08d}" / f"rank{rank}.json"


def _plain_sha256(doc: dict) -> str:
    """What format 1 checked: anyone who can write the file can compute it."""
    body = {k: v for k, v in doc.items() if k not in ("manifest_sha256", "manifest_hmac")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- signatures


def test_swapped_data_with_a_recomputed_plain_checksum_is_refused(tmp_path):
    """The attack format 1 allowed: replace a data file, fix its sha256 and the manifest's own checksum."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    _save(mine)
    _save(theirs, steps=(2,))  # other weights, a valid checkpoint of their own
    m = _manifest(mine, 1)
    doc = json.loads(m.read_text())
    their_doc = json.loads(_manifest(theirs, 2).read_text())
    (rel, entry), = [(r, e) for r, e in doc["files"].items() if r.endswith("__0_0.distcp")]
    their_rel = next(r for r in their_doc["files"] if r.endswith("__0_0.distcp"))
    (mine / "step_00000001" / rel).write_bytes((theirs / "step_00000002" / their_rel).read_bytes())
    doc["files"][rel] = their_doc["files"][their_rel]
    doc["manifest_sha256"] = _plain_sha256(doc)
    m.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"rank0.json: manifest signature mismatch: tampered, or written "
                                              r"by another job/key; "):
        load_checkpoint(mine, 1, rank=0, world_size=1, run_id=RUN, key=KEY)
    with pytest.warns(UserWarning, match="signature mismatch"):
        assert latest_valid_step(mine, world_size=1, run_id=RUN, key=KEY) is None


_FIELDS = st.sampled_from(["step", "generation", "world_size", "rank", "strategy", "run_id", "written_at",
                           "meta", "data_dir", "tensors", "files", "format_extra"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("signed")
    _save(directory)
    return directory


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=_FIELDS, value=st.one_of(st.integers(-3, 10**6), st.text(max_size=8), st.booleans(),
                                      st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)))
def test_any_edited_value_with_a_recomputed_plain_checksum_is_refused(saved, field, value):
    m = _manifest(saved, 1)
    original = m.read_bytes()
    doc = json.loads(original)
    if field in doc and json.dumps(doc[field]) == json.dumps(value):
        return  # not an edit
    doc[field] = value
    doc["manifest_sha256"] = _plain_sha256(doc)
    m.write_text(json.dumps(doc))
    try:
        with pytest.raises(CheckpointError, match="manifest signature mismatch"):
            verify_step(saved, 1, world_size=1, run_id=RUN, key=KEY)
    finally:
        m.write_bytes(original)
    verify_step(saved, 1, world_size=1, run_id=RUN, key=KEY)  # the original still verifies


def test_a_manifest_signed_with_another_key_is_refused(tmp_path):
    _save(tmp_path, steps=(1, 2))
    _save(tmp_path, steps=(3,), key=OTHER_KEY)  # another job's files in this directory
    with pytest.raises(CheckpointError, match="step_00000003/rank0.json: manifest signature mismatch.*another "
                                              "job/key"):
        load_checkpoint(tmp_path, 3, rank=0, world_size=1, run_id=RUN, key=KEY)
    with pytest.warns(UserWarning, match="skipping checkpoint step 3: .*signature mismatch"):
        assert latest_valid_step(tmp_path, world_size=1, run_id=RUN, key=KEY) == 2
    with pytest.warns(UserWarning, match="signature mismatch"):
        assert newest_own_valid_step(tmp_path, rank=0, world_size=1, run_id=RUN, key=OTHER_KEY, at_most=2) is None
    assert newest_own_valid_step(tmp_path, rank=0, world_size=1, run_id=RUN, key=OTHER_KEY) == 3


def test_a_format_1_manifest_is_refused_naming_the_format(tmp_path):
    _save(tmp_path)
    m = _manifest(tmp_path, 1)
    doc = json.loads(m.read_text())
    del doc["manifest_hmac"]
    doc["format"] = "unbroken-tier2/1"
    doc["manifest_sha256"] = _plain_sha256(doc)  # a perfectly valid format-1 manifest
    m.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"format 'unbroken-tier2/1' \(unsigned manifests\), this version "
                                              r"reads only signed 'unbroken-tier2/2'; export or resume it with"):
        load_checkpoint(tmp_path, 1, rank=0, world_size=1, run_id=RUN, key=KEY)


@pytest.mark.parametrize("key,what", [(b"short", "got 5 bytes"), ("k" * 32, "got str"), (None, "got NoneType")])
def test_the_key_is_validated_everywhere(tmp_path, key, what):
    _save(tmp_path)
    calls = [lambda: CheckpointWriter(tmp_path, rank=0, world_size=1, run_id=RUN, strategy="ddp", key=key),
             lambda: verify_step(tmp_path, 1, world_size=1, run_id=RUN, key=key),
             lambda: latest_valid_step(tmp_path, world_size=1, run_id=RUN, key=key),
             lambda: newest_own_valid_step(tmp_path, rank=0, world_size=1, run_id=RUN, key=key),
             lambda: load_checkpoint(tmp_path, 1, rank=0, world_size=1, run_id=RUN, key=key)]
    for call in calls:
        with pytest.raises(ValueError, match=f"key must be bytes of length >= 16 .*{what}; pass "
                                             r"unbroken.runtime.jobkey.read_job_key\(run_dir\)"):
            call()


# --------------------------------------------------------------------------- permissions


def _modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


def test_every_file_is_0600_and_every_directory_0700_whatever_the_umask(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    leftover = run / "checkpoints" / "step_00000002" / f".rank0.json.{os.getpid()}.tmp"
    old = os.umask(0o002)  # a permissive umask: group and others could read what DCP writes
    try:
        _save(run / "checkpoints", steps=(1,), world_size=2, keep=2)
        leftover.parent.mkdir()
        leftover.write_bytes(b"a crash's half-written manifest, 0664")
        leftover.parent.chmod(0o775)
        _save(run / "checkpoints", steps=(2, 3), world_size=2, keep=2)
    finally:
        os.umask(old)
    modes = _modes(run / "checkpoints")
    assert stat.S_IMODE((run / "checkpoints").stat().st_mode) == 0o700
    assert any(p.endswith(".distcp") for p in modes) and any(p.endswith("/.metadata") for p in modes)
    files = {p: m for p, m in modes.items() if not (run / "checkpoints" / p).is_dir()}
    dirs = {p: m for p, m in modes.items() if (run / "checkpoints" / p).is_dir()}
    assert set(files.values()) == {0o600}, files
    # step 2's directory existed already (the crash made it): it keeps its mode, everything new is 0700
    assert {p: m for p, m in dirs.items() if m != 0o700} == {"step_00000002": 0o775}
    assert any(p.endswith(".dcp") for p in dirs) and "step_00000003" in dirs
