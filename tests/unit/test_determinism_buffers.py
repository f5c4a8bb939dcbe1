"""Per-step seeding, input fingerprints, and the exact buffer codec (pure logic)."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.buffers import ModelBuffers
from unbroken.runtime.determinism import BATCH, FORWARD, InputFingerprints, seed_everything, step_seed


@given(seed=st.integers(0, 2**31), step=st.integers(1, 10**6), rank=st.integers(0, 4096))
def test_step_seed_is_pure_and_distinguishes_its_inputs(seed, step, rank):
    s = step_seed(seed, step, rank, BATCH)
    assert s == step_seed(seed, step, rank, BATCH) and 0 <= s < 2**63
    assert s != step_seed(seed, step + 1, rank, BATCH)
    assert s != step_seed(seed, step, rank + 1, BATCH)
    assert s != step_seed(seed, step, rank, FORWARD)


def test_seed_everything_replays_python_numpy_and_torch_draws():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    seed_everything(3, 17, 2, BATCH)
    first = draws()
    draws()  # the first attempt consumed more
    seed_everything(3, 17, 2, BATCH)
    assert draws() == first
    seed_everything(3, 17, 1, BATCH)
    assert draws() != first


def test_fingerprints_flag_the_ranks_whose_redo_differs():
    fp = InputFingerprints(keep=3)
    assert fp.observe(5, torch.tensor([1.0, 2.0, 3.0])) == []
    assert fp.observe(5, torch.tensor([1.0, 2.0, 3.0])) == []
    assert fp.observe(5, torch.tensor([1.0, 2.5, -3.0])) == [1, 2]
    assert fp.observe(5, torch.tensor([1.0, 2.0, 3.0])) == []  # compared with the first record
    for s in (6, 7, 8):
        fp.observe(s, torch.zeros(3))
    assert fp.value(5) is None  # only the last `keep` steps are kept


class _WithBuffers(nn.Module):
    def __init__(self, dtypes):
        super().__init__()
        for i, dt in enumerate(dtypes):
            self.register_buffer(f"b{i}", torch.zeros(3 + i, dtype=dt))


@settings(max_examples=30, deadline=None)
@given(dtypes=st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8,
                                         torch.float16, torch.bool]), min_size=1, max_size=5),
       seed=st.integers(0, 1000), ranks=st.integers(1, 8))
def test_buffers_survive_the_summed_all_reduce_bit_for_bit(dtypes, seed, ranks):
    m = _WithBuffers(dtypes)
    g = torch.Generator().manual_seed(seed)
    for b in m.buffers():
        raw = torch.randint(0, 256, (b.numel() * b.element_size(),), generator=g, dtype=torch.uint8)
        b.copy_(raw.view(b.dtype).view(b.shape))  # any bit pattern: NaN, -0.0, denormals
    want = [b.clone() for b in m.buffers()]
    codec = ModelBuffers(m)
    words = torch.zeros(codec.words)
    codec.encode(words)
    total = words.clone()
    for _ in range(ranks - 1):
        total += torch.zeros_like(words)  # every other rank sends zeros
    for b in m.buffers():
        b.zero_()
    codec.commit(total)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(want, m.buffers()))
    for b in m.buffers():
        b.fill_(1)
    codec.restore()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(want, m.buffers()))
