"""Which tier-2 step the ranks share: retention pinned to the newest step every rank committed
(an AND of bitmasks, one all-reduce per checkpoint), and the O(N) own-files vote of a restore."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.protect import tier2
from unbroken.protect.tier2 import (MASK_SLOTS, CheckpointWriter, latest_valid_step, newest_in_mask,
                                    newest_own_valid_step, step_mask)
from unbroken.runtime.persist import Persistence
from unbroken.runtime.recovery import agree_on_step

RUN = "run-a"
KEY = bytes(range(32))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {"params": torch.randn(32, generator=torch.Generator().manual_seed(seed))}


def _writer(directory: Path, rank: int, world_size: int = 2, keep: int = 2) -> CheckpointWriter:
    return CheckpointWriter(directory, rank=rank, world_size=world_size, run_id=RUN, strategy="zero1", key=KEY,
                            keep=keep)


def _ranks_with(directory: Path, step: int) -> list[int]:
    return sorted(int(p.stem[4:]) for p in (directory / f"step_{step:08d}").glob("rank*.json"))


class FakeComm:
    """An all-reduce over threads that stand for ranks (MIN and BAND, as gloo does them)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world
        self.calls = 0

    def for_rank(self, rank: int):
        return SimpleNamespace(allreduce=lambda t, op, what: self._allreduce(rank, t, op),
                               and_allreduce=lambda t, what: self._allreduce(rank, t, dist.ReduceOp.BAND))

    def _allreduce(self, rank: int, t: torch.Tensor, op) -> None:
        self.slots[rank] = int(t)
        self.barrier.wait()
        values = list(self.slots)
        if rank == 0:
            self.calls += 1
        self.barrier.wait()  # everyone has read the slots before the next round writes them
        if op == dist.ReduceOp.MIN:
            t.fill_(min(values))
        elif op == dist.ReduceOp.BAND:
            out = values[0]
            for v in values[1:]:
                out &= v
            t.fill_(out)
        else:
            raise AssertionError(f"unexpected reduce op {op}")


def _on_ranks(world: int, fn) -> list:
    """fn(rank) on one thread per rank; the results in rank order (re-raising a thread's error)."""
    results, errors = [None] * world, []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


# --------------------------------------------------------------------------- masks


def test_gloo_bitwise_and_of_int64_masks_on_cpu():
    """The pin's collective: gloo reduces int64 with BAND on CPU, high bits included."""
    store, masks = dist.HashStore(), [(1 << 62) | (1 << 40) | 0b1011, (1 << 62) | 0b0110, (1 << 62) | (1 << 40) | 0b10]

    def reduce(rank: int) -> int:
        pg = dist.ProcessGroupGloo(store, rank, 3)
        t = torch.tensor([masks[rank]], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BAND
        pg.allreduce([t], opts).wait()
        return int(t)

    assert _on_ranks(3, reduce) == [(1 << 62) | 0b10] * 3


@settings(max_examples=200, deadline=None)
@given(every=st.integers(1, 7), newest_slot=st.integers(0, 80),
       ranks=st.lists(st.sets(st.integers(0, 80)), min_size=1, max_size=5))
def test_the_and_of_masks_is_the_newest_step_every_rank_committed(every, newest_slot, ranks):
    newest = newest_slot * every
    committed = [{s * every for s in slots} | {newest + every} for slots in ranks]  # + a step in flight
    masks = [step_mask(c, newest, every) for c in committed]
    assert all(0 <= m < 2**63 for m in masks)  # an int64 all-reduce carries it
    agreed = masks[0]
    for m in masks[1:]:
        agreed &= m
    window = {s for s in set.intersection(*committed) if newest - (MASK_SLOTS - 1) * every <= s <= newest}
    assert newest_in_mask(agreed, newest, every) == (max(window) if window else None)


def test_masks_reject_a_bad_interval():
    with pytest.raises(ValueError, match="every must be the checkpoint interval, an integer >= 1, got 0"):
        step_mask({1}, 10, 0)


# --------------------------------------------------------------------------- pinned retention


def test_retention_keeps_the_common_step_when_one_rank_lags(tmp_path):
    """Rank 1's writes after step 10 are missing (its process died, the replacement has not written
    yet): rank 0's keep=2 alone would delete step 10, the only step both ranks hold."""
    w0, w1 = _writer(tmp_path, 0), _writer(tmp_path, 1)
    w0.save_async(10, 0, _state(0))
    w1.save_async(10, 0, _state(1))
    w1.close()
    for t in (20, 30, 40):
        w0.wait()
        masks = [step_mask(w.committed_steps(), t - 10, 10) for w in (w0, w1)]
        w0.pin(newest_in_mask(masks[0] & masks[1], t - 10, 10))
        w0.save_async(t, 0, _state(t))
    w0.close()
    assert w0.committed_steps() == {10, 30, 40} and _ranks_with(tmp_path, 10) == [0, 1]
    assert not (tmp_path / "step_00000020").exists()
    with pytest.warns(UserWarning, match="rank1.json: missing"):
        assert latest_valid_step(tmp_path, world_size=2, run_id=RUN, key=KEY) == 10
    w0 = _writer(tmp_path, 0)  # a new pin releases the old one
    w0.pin(40)
    w0.save_async(50, 0, _state(50))
    w0.close()
    assert _ranks_with(tmp_path, 10) == [1] and w0.committed_steps() == {40, 50}


def test_a_replacement_writer_knows_what_its_predecessor_committed(tmp_path):
    for step in (10, 20):  # two processes of rank 1, one after the other
        w = _writer(tmp_path, 1)
        w.save_async(step, 0, _state(step))
        w.close()
    assert _writer(tmp_path, 1).committed_steps() == {10, 20} and _writer(tmp_path, 0).committed_steps() == set()
    with pytest.raises(ValueError, match="pin takes a committed step >= 0, got -1"):
        _writer(tmp_path, 0).pin(-1)


def test_the_worker_pins_the_common_step_with_one_band_all_reduce_per_checkpoint(tmp_path):
    """Persistence._maybe_checkpoint on two simulated ranks: rank 1 stops writing after step 10."""
    comm = FakeComm(2)
    writers = [_writer(tmp_path, 0), _writer(tmp_path, 1)]
    skip = {(1, 20), (1, 30), (1, 40)}
    trainers = [SimpleNamespace(
        cfg=SimpleNamespace(checkpoint_every=10, strategy="zero1"), ckpt=w, comm=comm.for_rank(r),
        owned=SimpleNamespace(sharded=True, tensors=lambda r=r: _state(r)), world_size=2, gen=SimpleNamespace(gen=0),
        ctx=SimpleNamespace(set_phase=lambda *a: None), _point=lambda *a: None) for r, w in enumerate(writers)]
    for tr in trainers:
        tr._pin_common_step = Persistence._pin_common_step.__get__(tr)
        if tr.ckpt.rank == 1:  # its writes go missing, its votes do not
            real = tr.ckpt.save_async
            tr.ckpt.save_async = lambda t, *a, _real=real: None if (1, t) in skip else _real(t, *a)

    def train(rank: int) -> None:
        for t in (0, 10, 20, 30, 40):
            Persistence._maybe_checkpoint(trainers[rank], t)
        writers[rank].close()

    _on_ranks(2, train)
    assert comm.calls == 4  # steps 10..40; none at step 0 (nothing can be committed before it)
    assert writers[0].pinned == writers[1].pinned == 10
    assert _ranks_with(tmp_path, 10) == [0, 1] and writers[0].committed_steps() == {10, 30, 40}


# --------------------------------------------------------------------------- the own-files vote


def _corrupt(directory: Path, step: int, rank: int) -> None:
    sdir = directory / f"step_{step:08d}"
    data = sdir / json.loads((sdir / f"rank{rank}.json").read_text())["data_dir"] / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 1
    data.write_bytes(bytes(blob))


def test_each_rank_checks_only_its_own_files_and_the_vote_finds_the_newest_common_step(tmp_path, monkeypatch):
    world = 4
    for r in range(world):
        w = _writer(tmp_path, r, world_size=world, keep=5)
        for step in (1, 2, 3, 4):
            if (r, step) != (3, 4):  # rank 3 never finished step 4
                w.save_async(step, 0, _state(10 * step + r))
        w.close()
    _corrupt(tmp_path, 3, 1)  # rank 1's step 3: the others' step 3 is fine
    read, real = [], tier2.read_manifest
    monkeypatch.setattr(tier2, "read_manifest", lambda d, s, **k: read.append(
        (threading.current_thread().name, k["rank"], s)) or real(d, s, **k))
    comm = FakeComm(world)

    def vote(rank: int) -> int | None:
        cache: dict[int, bool] = {}
        return agree_on_step(comm.for_rank(rank), lambda at_most: newest_own_valid_step(
            tmp_path, rank=rank, world_size=world, run_id=RUN, key=KEY, at_most=at_most, cache=cache))

    with pytest.warns(UserWarning) as caught:
        assert _on_ranks(world, vote) == [2] * world
    assert all(name == f"rank{r}" for name, r, _ in read)  # no rank read another rank's files
    assert len(read) == len(set(read))  # each (rank, step) checked at most once
    assert sorted((r, s) for _, r, s in read) == [(r, s) for r in range(world) for s in (2, 3, 4)]
    assert {str(w.message).split(":")[0] for w in caught} == {"skipping checkpoint step 3",
                                                              "skipping checkpoint step 4"}
    assert comm.calls == 3  # MIN of newest own (3, 4, 4, 3) -> 3; rank 1 says 2 -> 2; all say 2 -> done


@settings(max_examples=150, deadline=None)
@given(valid=st.lists(st.sets(st.integers(0, 12)), min_size=1, max_size=5))
def test_the_vote_is_the_newest_step_valid_on_every_rank(valid):
    comm = FakeComm(len(valid))

    def vote(rank: int) -> int | None:
        own = valid[rank]
        return agree_on_step(comm.for_rank(rank), lambda at_most: max(
            (s for s in own if at_most is None or s <= at_most), default=None))

    common = set.intersection(*valid)
    assert _on_ranks(len(valid), vote) == [max(common) if common else None] * len(valid)
