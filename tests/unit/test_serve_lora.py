"""Batched multi-adapter LoRA vs the per-row reference, PEFT's format and library, the LRU cache."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from unbroken.models.data import VOCAB_SIZE
from unbroken.models.gpt import build_model
from unbroken.serve.adapters import RequestError, read_adapter, write_adapter
from unbroken.serve.cache import AdapterCache
from unbroken.serve.config import base_model_id, lora_targets, serve_model
from unbroken.serve.lora import SlotTable, inject, reference_forward

torch.set_num_threads(1)
MODEL = serve_model()
BASE = base_model_id(MODEL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    for i, r in enumerate((2, 4, 8)):
        write_adapter(d, f"a{i}", model=MODEL, rank=r, seed=i, std=0.2)
    table = SlotTable(lora_targets(MODEL), 3, 8)
    model = inject(build_model(MODEL, VOCAB_SIZE, 0).eval(), table)
    for i in range(3):
        table.put(i + 1, read_adapter(d, f"a{i}", model=MODEL, base=BASE, max_rank=8))
    return model, table


@settings(max_examples=15, deadline=None)
@given(rows=st.lists(st.integers(0, 3), min_size=1, max_size=5), t=st.integers(1, 12), seed=st.integers(0, 99))
def test_batched_lora_matches_one_adapter_at_a_time(served, rows, t, seed):
    model, table = served
    idx = torch.randint(0, VOCAB_SIZE, (len(rows), t), generator=torch.Generator().manual_seed(seed))
    table.use(rows)
    with torch.inference_mode():
        fast = model(idx)
        ref = reference_forward(model, table, idx, rows)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_adapters_change_the_output_and_slot_zero_is_the_base(served):
    model, table = served
    idx = torch.arange(8)[None].repeat(4, 1)
    table.use([0, 1, 2, 3])
    with torch.inference_mode():
        out = model(idx)
    for i in range(1, 4):
        assert (out[i] - out[0]).abs().max() > 1e-3


def test_read_adapter_rejects_wrong_base_rank_and_unknown(tmp_path):
    write_adapter(tmp_path, "other", model=MODEL, rank=4, seed=0, base="someone/else")
    write_adapter(tmp_path, "wide", model=MODEL, rank=32, seed=0)
    with pytest.raises(RequestError, match="trained for base"):
        read_adapter(tmp_path, "other", model=MODEL, base=BASE, max_rank=16)
    with pytest.raises(RequestError, match="beyond this server's limit") as e:
        read_adapter(tmp_path, "wide", model=MODEL, base=BASE, max_rank=16)
    assert e.value.status == 400
    with pytest.raises(RequestError, match="unknown adapter") as e:
        read_adapter(tmp_path, "missing", model=MODEL, base=BASE, max_rank=16)
    assert e.value.status == 404
    with pytest.raises(RequestError, match="not valid"):
        read_adapter(tmp_path, "../etc", model=MODEL, base=BASE, max_rank=16)


def test_lru_cache_evicts_least_recent_unpinned_only():
    loaded = []
    c = AdapterCache(2, lambda name, slot: loaded.append((name, slot)))
    sa = c.acquire("a")
    sb = c.acquire("b")
    assert c.acquire("c") is None  # both slots pinned: c waits
    c.release(sa)
    assert c.acquire("c") == sa and c.evictions == 1  # a was the only unpinned one
    c.release(sb)
    c.release(sa)
    assert c.acquire("c") == sa and c.hits == 1  # c is now the most recent, so b goes next
    c.release(sa)
    assert c.acquire("d") == sb and "b" not in c.resident()
    assert loaded == [("a", 1), ("b", 2), ("c", 1), ("d", 2)]
