"""fsdp's owned-shard layout is FSDP2's: each parameter split on dim 0 as torch.chunk does,
padded slots concatenated; the slots all-gathered give the parameter back."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.fsdp_layout import FsdpLayout

shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, world=st.integers(1, 5))
def test_each_rank_holds_torch_chunk_of_every_parameter_and_the_gather_gives_it_back(shapes, world):
    params = [torch.randn(*s) for s in shapes]
    lay = FsdpLayout([p.shape for p in params], [f"p{i}" for i in range(len(params))], world)
    full = torch.cat([p.reshape(-1) for p in params])
    shards = []
    for r in range(world):
        shard = torch.full((lay.size,), float("nan"))
        lay.shard_from_full(full, shard, r)
        shards.append(shard)
        for i, p in enumerate(params):
            chunks = torch.chunk(p, world, dim=0)
            mine = chunks[r].reshape(-1) if r < len(chunks) else torch.empty(0)
            s = lay.slots[i]
            assert torch.equal(shard[s.offset:s.offset + mine.numel()], mine)
            assert not shard[s.offset + mine.numel():s.offset + s.size].any()  # padding is zero
    for i, p in enumerate(params):
        s = lay.slots[i]
        gathered = torch.cat([sh[s.offset:s.offset + s.size] for sh in shards])
        assert torch.equal(lay.full_from_slots(gathered, i), p.reshape(-1))


def test_runs_skip_padding_and_merge_neighbours_of_one_group():
    lay = FsdpLayout([torch.Size([3, 2]), torch.Size([4]), torch.Size([2])], ["a", "b", "c"], world=2)
    # slots: a 2 rows x 2 = 4, b 2, c 1; rank 1 holds a's row 2 (2 elements), b's 2, c's 1
    assert lay.runs(0, [0, 0, 1]) == [(0, 6, 0), (6, 7, 1)]
    assert lay.runs(1, [0, 0, 0]) == [(0, 2, 0), (4, 7, 0)]


def test_a_scalar_parameter_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="scalar.*zero3"):
        FsdpLayout([torch.Size([])], ["temperature"], world=2)
