"""Tier-2 checkpoints: bitwise roundtrip, non-blocking snapshots, retention, and every way a file goes bad."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unbroken.events import EventLog, read_events
from unbroken.protect import tier2
from unbroken.protect.codes import as_bytes
from unbroken.protect.tier2 import (CheckpointError, CheckpointWriteError, CheckpointWriter,
                                    latest_valid_step, load_checkpoint, verify_step)

RUN = "run-a"
KEY = bytes(range(32))  # the job key (runtime/jobkey.py): manifests are signed with it
# DCP warns on every no_dist save; tier2 filters it process-wide, but pytest resets filters per test.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    return {
        "w": torch.randn(37, 5, generator=g),
        "nan": nan_payload,  # NaNs with payloads: only a bitwise comparison sees them survive
        "bf16": torch.randn(11, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "i64": torch.randint(-2**62, 2**62, (9,), generator=g),
        "u8": torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),
        "mask": torch.rand(6, generator=g) > 0.5,
        "scalar": torch.tensor(seed + 0.25, dtype=torch.float64),
        "layer.0.exp_avg": torch.randn(4, 6, generator=g).t(),  # non-contiguous source
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(as_bytes(a[k].contiguous()), as_bytes(b[k].contiguous())) for k in a)


def _save(directory: Path, step: int, *, world_size: int = 2, ranks=None, seed: int | None = None,
          run_id: str = RUN, keep: int = 5) -> None:
    for rank in range(world_size) if ranks is None else ranks:
        with CheckpointWriter(directory, rank=rank, world_size=world_size, run_id=run_id, key=KEY,
                              strategy="zero1", keep=keep) as w:
            w.save_async(step, 0, _state(step * 10 + rank if seed is None else seed), meta={"rank": rank})


def _data_file(directory: Path, step: int, rank: int, name: str = "__0_0.distcp") -> Path:
    doc = json.loads((directory / f"step_{step:08d}" / f"rank{rank}.json").read_text())
    return directory / f"step_{step:08d}" / doc["data_dir"] / name


def _flip_byte(path: Path, offset: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tmp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------- roundtrip


def test_roundtrip_is_bitwise_for_every_dtype(tmp_path):
    _save(tmp_path, 7)
    for rank in range(2):
        got, info = load_checkpoint(tmp_path, 7, rank=rank, world_size=2, run_id=RUN, key=KEY)
        assert _same(got, _state(70 + rank))
        assert info == {"step": 7, "generation": 0, "world_size": 2, "rank": rank, "strategy": "zero1",
                        "run_id": RUN, "meta": {"rank": rank}}


def test_load_into_preallocated_tensors_in_place(tmp_path):
    _save(tmp_path, 3, world_size=1)
    into = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in _state(30).items()}
    got, _ = load_checkpoint(tmp_path, 3, rank=0, world_size=1, run_id=RUN, key=KEY, into=into)
    assert got is into and _same(into, _state(30))
    into["w"] = torch.empty(2, 2)
    with pytest.raises(CheckpointError, match="rank0.json.*holds tensors"):
        load_checkpoint(tmp_path, 3, rank=0, world_size=1, run_id=RUN, key=KEY, into=into)


def test_each_rank_directory_is_a_plain_dcp_checkpoint(tmp_path):
    _save(tmp_path, 5, world_size=1)
    target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in _state(50).items()}
    dcp.load(target, checkpoint_id=_data_file(tmp_path, 5, 0).parent, no_dist=True)
    assert _same(target, _state(50))


# --------------------------------------------------------------------------- not blocking


@pytest.fixture
def gated_save(monkeypatch):
    """DCP writes wait for the test to open the gate: a write 'in progress' for as long as we like."""
    gate, real_save = threading.Event(), dcp.save

    def slow_save(*args, **kwargs):
        assert gate.wait(30), "test never opened the gate"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(tier2.dcp, "save", slow_save)
    return gate


def test_save_async_returns_before_the_write_and_snapshots_the_data(tmp_path, gated_save):
    w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp", wait_timeout=0.2)
    src = _state(1)
    w.save_async(1, 0, src)  # returns although the write cannot have started
    for t in src.values():
        t.zero_()  # the training loop moves on and mutates its tensors
    with pytest.raises(TimeoutError, match="step 1 still writing"):
        w.wait(timeout=0.05)
    with pytest.raises(TimeoutError, match="step 1"):
        w.save_async(2, 0, src)  # must not overwrite buffers that are still being written
    gated_save.set()
    w.close()
    got, _ = load_checkpoint(tmp_path, 1, rank=0, world_size=1, run_id=RUN, key=KEY)
    assert _same(got, _state(1))


def test_snapshot_buffers_are_allocated_once_and_reused(tmp_path):
    w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp")
    w.save_async(1, 0, _state(1))
    first = {k: b.data_ptr() for k, b in w._buffers.items()}
    w.save_async(2, 0, _state(2))
    assert {k: b.data_ptr() for k, b in w._buffers.items()} == first
    w.close()
    assert _same(load_checkpoint(tmp_path, 2, rank=0, world_size=1, run_id=RUN, key=KEY)[0], _state(2))


def test_write_from_thread_while_a_process_group_is_live(tmp_path, monkeypatch):
    """The writer thread must never join a collective: it would interleave with training's."""
    from_writer = []
    for name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                 "barrier", "all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        real = getattr(dist, name)

        def spy(*a, _real=real, _name=name, **k):
            if threading.current_thread().name.startswith("unbroken-tier2"):
                from_writer.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(dist, name, spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp")
        w.save_async(4, 1, _state(4))
        x = torch.ones(1000)
        for _ in range(20):  # collectives on the training thread during the background write
            dist.all_reduce(x)
        w.close()
    finally:
        dist.destroy_process_group()
    assert from_writer == [] and torch.equal(x, torch.ones(1000))
    assert _same(load_checkpoint(tmp_path, 4, rank=0, world_size=1, run_id=RUN, key=KEY)[0], _state(4))


# --------------------------------------------------------------------------- retention, events


def test_retention_keeps_the_last_k_and_removes_empty_step_dirs(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", source="test", rank=0)
    w = CheckpointWriter(tmp_path / "ck", rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp", keep=2,
                         events=log)
    for step in (10, 20, 30, 40):
        w.save_async(step, 0, _state(step))
    w.close()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000030", "step_00000040"]
    saved = [e for e in read_events(tmp_path) if e.kind == "checkpoint_saved"]
    assert [e.fields["step"] for e in saved] == [10, 20, 30, 40]
    assert {"step", "path", "bytes", "save_s"} <= saved[-1].fields.keys()
    assert saved[-1].fields["bytes"] > 0 and saved[-1].fields["path"].endswith("rank0.json")


def test_retention_never_touches_other_ranks_files(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, ranks=[1], keep=2)  # rank 1 lags behind
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, ranks=[0], keep=2)
    names = {p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("step_*/rank*.json")}
    assert names == {"step_00000002/rank1.json", "step_00000003/rank0.json",
                     "step_00000003/rank1.json", "step_00000004/rank0.json"}
    assert not (tmp_path / "step_00000001").exists()
    with pytest.warns(UserWarning, match="step_00000004/rank1.json: missing"):
        assert latest_valid_step(tmp_path, world_size=2, run_id=RUN, key=KEY) == 3


def test_resaving_a_step_replaces_it_and_drops_the_old_data(tmp_path):
    _save(tmp_path, 9, world_size=1, seed=1)
    old_dir = _data_file(tmp_path, 9, 0).parent
    _save(tmp_path, 9, world_size=1, seed=2)  # after a rollback the step is written again
    assert not old_dir.exists()
    assert _same(load_checkpoint(tmp_path, 9, rank=0, world_size=1, run_id=RUN, key=KEY)[0], _state(2))


# --------------------------------------------------------------------------- bad files


def _invalid_events(tmp_path: Path) -> list:
    return [e for e in read_events(tmp_path / "events.jsonl") if e.kind == "checkpoint_invalid"]


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_corrupted_file_falls_back_to_previous_step_with_event(tmp_path, victim, monkeypatch):
    ck = tmp_path / "ck"
    _save(ck, 1)
    _save(ck, 2)
    bad = _data_file(ck, 2, 1, victim)
    _flip_byte(bad, offset=len(bad.read_bytes()) // 2)
    log = EventLog(tmp_path / "events.jsonl", source="test")
    with pytest.warns(UserWarning, match=f"{bad.name}.*sha256 mismatch"):
        assert latest_valid_step(ck, world_size=2, run_id=RUN, key=KEY, events=log) == 1
    (ev,) = _invalid_events(tmp_path)
    assert ev.fields["path"] == str(bad) and "sha256" in ev.fields["error"]

    def must_not_deserialize(*a, **k):
        raise AssertionError("deserialized unverified bytes")

    monkeypatch.setattr(tier2.dcp, "load", must_not_deserialize)
    with pytest.raises(CheckpointError, match=f"{bad.name}: sha256 mismatch") as info:
        load_checkpoint(ck, 2, rank=1, world_size=2, run_id=RUN, key=KEY)
    assert info.value.path == str(bad)


def test_truncated_data_file_is_reported_by_size(tmp_path):
    _save(tmp_path, 1, world_size=1)
    bad = _data_file(tmp_path, 1, 0)
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path, 1, rank=0, world_size=1, run_id=RUN, key=KEY)


def test_truncated_or_edited_manifest_is_skipped(tmp_path):
    ck = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(ck, step)
    m2 = ck / "step_00000002" / "rank0.json"
    m3 = ck / "step_00000003" / "rank1.json"
    m3.write_bytes(m3.read_bytes()[:40])
    doc = json.loads(m2.read_text())
    doc["generation"] = 5  # still valid JSON: only the manifest's signature notices
    m2.write_text(json.dumps(doc))
    log = EventLog(tmp_path / "events.jsonl", source="test")
    with pytest.warns(UserWarning) as caught:
        assert latest_valid_step(ck, world_size=2, run_id=RUN, key=KEY, events=log) == 1
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert f"{m3}: unreadable or truncated manifest" in messages[0]
    assert f"{m2}: manifest signature mismatch" in messages[1]
    assert [e.fields["path"] for e in _invalid_events(tmp_path)] == [str(m3), str(m2)]
    with pytest.raises(CheckpointError, match="rank0.json.*signature mismatch"):
        load_checkpoint(ck, 2, rank=0, world_size=2, run_id=RUN, key=KEY)


def test_wrong_run_id_and_world_size_are_named(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="rank0.json.*belongs to run 'run-a', not 'run-b'"):
        load_checkpoint(tmp_path, 1, rank=0, world_size=2, run_id="run-b", key=KEY)
    with pytest.raises(CheckpointError, match="world size 2, this job has 4"):
        load_checkpoint(tmp_path, 1, rank=0, world_size=4, run_id=RUN, key=KEY)
    with pytest.warns(UserWarning, match="belongs to run"):
        assert latest_valid_step(tmp_path, world_size=2, run_id="run-b", key=KEY) is None
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path, 8, rank=0, world_size=2, run_id=RUN, key=KEY)


def test_incomplete_step_is_skipped(tmp_path):
    ck = tmp_path / "ck"
    _save(ck, 1)
    _save(ck, 2, ranks=[0])  # rank 1 died before writing step 2
    log = EventLog(tmp_path / "events.jsonl", source="test")
    with pytest.warns(UserWarning, match="rank1.json: missing"):
        assert latest_valid_step(ck, world_size=2, run_id=RUN, key=KEY, events=log) == 1
    assert _invalid_events(tmp_path)[0].fields["path"].endswith("step_00000002/rank1.json")
    assert latest_valid_step(tmp_path / "nowhere", world_size=2, run_id=RUN, key=KEY) is None


# --------------------------------------------------------------------------- atomicity


def test_no_temp_files_after_close_and_crash_leftovers_are_ignored_then_cleaned(tmp_path):
    _save(tmp_path, 1)
    assert _tmp_files(tmp_path) == []
    # A crash mid-write of step 2: DCP temp dir and manifest temp file, no manifest.
    s2 = tmp_path / "step_00000002"
    (s2 / "rank0.g0-deadbeef.dcp.tmp").mkdir(parents=True)
    (s2 / "rank0.g0-deadbeef.dcp.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (s2 / ".rank0.json.999.tmp").write_bytes(b'{"step": 2')
    (tmp_path / "step_00000001" / ".rank1.json.999.tmp").write_bytes(b"junk")
    with pytest.warns(UserWarning, match="missing"):
        assert latest_valid_step(tmp_path, world_size=2, run_id=RUN, key=KEY) == 1
    verify_step(tmp_path, 1, world_size=2, run_id=RUN, key=KEY)
    assert _same(load_checkpoint(tmp_path, 1, rank=1, world_size=2, run_id=RUN, key=KEY)[0], _state(11))
    _save(tmp_path, 2)  # the retry of step 2 clears its own leftovers
    # rank 1's leftover in step 1 stays until its retention drops step 1; loaders never read it
    assert [p.name for p in _tmp_files(tmp_path)] == [".rank1.json.999.tmp"]
    assert latest_valid_step(tmp_path, world_size=2, run_id=RUN, key=KEY) == 2


def test_background_failure_surfaces_on_wait(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    w = CheckpointWriter(blocker, rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp")
    w.save_async(3, 0, _state(3))
    with pytest.raises(CheckpointWriteError, match="step 3.*failed"):
        w.wait()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.save_async(4, 0, _state(4))


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("kwargs,match", [
    ({"rank": 2, "world_size": 2}, "rank must be"), ({"world_size": 0}, "world_size must be"),
    ({"keep": 0}, "keep must be"), ({"run_id": ""}, "run_id must be"),
    ({"wait_timeout": 0}, "wait_timeout must be")])
def test_writer_arguments_are_validated(tmp_path, kwargs, match):
    args = {"rank": 0, "world_size": 1, "run_id": RUN, "strategy": "ddp", "key": KEY, **kwargs}
    with pytest.raises(ValueError, match=match):
        CheckpointWriter(tmp_path, **args)


def test_save_arguments_are_validated(tmp_path):
    w = CheckpointWriter(tmp_path, rank=0, world_size=1, run_id=RUN, key=KEY, strategy="ddp")
    with pytest.raises(ValueError, match="step must be"):
        w.save_async(-1, 0, _state())
    with pytest.raises(ValueError, match="non-empty dict"):
        w.save_async(1, 0, {})
    with pytest.raises(ValueError, match="torch.Tensor"):
        w.save_async(1, 0, {"x": [1, 2]})
    with pytest.raises(ValueError, match="JSON-serializable"):
        w.save_async(1, 0, _state(), meta={"f": object()})
    w.close()
    assert list(tmp_path.iterdir()) == []
