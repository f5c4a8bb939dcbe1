"""zero3's per-unit parameters (parallel/units.py) in one process: the units and their pieces,
gradients bitwise equal to the plain model's, every unit's bytes freed outside its use."""
from __future__ import annotations

import copy

import torch

from unbroken.config import ModelConfig
from unbroken.models.gpt import build_model
from unbroken.parallel.flat import FlatModel
from unbroken.parallel.units import UnitParams, unit_modules

CFG = ModelConfig(n_layer=3, n_embd=32, n_head=2, seq_len=16)


def _pair():
    plain = build_model(CFG, 65, seed=3)
    sharded = copy.deepcopy(plain)
    flat = FlatModel(list(sharded.named_parameters()), world=1, chunk_elems=1024, multiple=1)
    shard = flat.params[:flat.shard].clone()
    units = UnitParams(sharded, flat.plist, lambda: shard, rank=0, world=1, shard=flat.shard, comm=lambda: None)
    flat.params = None  # as OwnedState.drop_full: only the shard is left
    return plain, sharded, flat, units


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 65, (4, 16), generator=g), torch.randint(0, 65, (4, 16), generator=g)


def test_blocks_are_units_and_the_tied_embedding_stays_in_the_root():
    plain, sharded, flat, units = _pair()
    assert [u.name for u in units.units] == ["blocks.0", "blocks.1", "blocks.2"]
    root = {flat.names[i] for i in units.root.index}
    assert "tok.weight" in root and not any(n.startswith("blocks.") for n in root)
    assert [n for n, _ in unit_modules(plain, list(plain.parameters()))] == ["blocks.0", "blocks.1", "blocks.2"]


def test_pieces_follow_the_owners_shards():
    plain = build_model(CFG, 65, seed=3)
    flat = FlatModel(list(plain.named_parameters()), world=4, chunk_elems=256, multiple=1)
    units = UnitParams(plain, flat.plist, lambda: None, rank=1, world=4, shard=flat.shard, comm=lambda: None)
    offsets = units.offsets
    for u in units.all_units():
        covered = 0
        for a, b, owner, rel in u.pieces:
            assert 0 <= rel and rel + (b - a) <= flat.shard and 0 <= owner < 4
            covered += b - a
        assert covered == sum(b - a for a, b in u.views) <= u.numel
        assert all(a % 16 == offsets[i] % 16 for i, (a, _) in zip(u.index, u.views))  # zero2's alignment
        # each parameter's first element comes from the rank whose shard holds its flat offset
        for i, (a, _) in zip(u.index, u.views):
            piece = next(p for p in u.pieces if p[0] <= a < p[1])
            assert piece[2] * flat.shard + piece[3] + (a - piece[0]) == offsets[i]


def test_a_step_gives_the_plain_models_bits_and_frees_every_unit():
    plain, sharded, flat, units = _pair()
    assert all(p.untyped_storage().nbytes() == 0 for p in flat.plist)
    losses = []
    for i in range(2):  # two micro-batches: the first accumulates in .grad, the last is captured
        x, y = _batch(i)
        plain.loss(x, y).backward()
        if i == 0:
            units.begin_step()
        else:
            units.capture(flat.grads)
        loss = sharded.loss(x, y)
        losses.append(float(loss.detach()))
        loss.backward()
    flat.collect_grads(sum(losses), units.end_step())
    want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    assert torch.equal(flat.grads[:flat.n], want)
    assert all(p.untyped_storage().nbytes() == 0 and p.grad is None for p in flat.plist)


def test_an_evaluation_forward_gathers_and_frees():
    plain, sharded, flat, units = _pair()
    x, _ = _batch(7)
    with torch.no_grad():
        assert torch.equal(plain(x), sharded(x))
    assert all(p.untyped_storage().nbytes() == 0 for p in flat.plist)
    units.close()
    assert all(p.untyped_storage().nbytes() > 0 for p in flat.plist)
