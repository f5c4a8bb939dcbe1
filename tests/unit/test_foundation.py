"""Config validation, sampler determinism, model shapes, fault specs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.config import ConfigError, ModelConfig, RunConfig, build_config
from unbroken.models import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model
from unbroken.runtime.faults import FaultSpec, chaos_schedule


@pytest.mark.parametrize("kwargs,needle", [
    ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
    ({"steps": -1}, "steps must be an integer >= 1"),
    ({"strategy": "fsdp9"}, "strategy must be one of zero1, zero2, zero3, ddp"),
    ({"world_size": 6, "parity_group": 4}, "must divide world_size"),
    ({"hang_timeout_s": 0.1}, "at least 3 heartbeats"),
    ({"lr": 0}, "lr must be > 0"),
])
def test_config_errors_name_the_field_and_value(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**kwargs)


def test_config_unknown_key_and_file_precedence(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        RunConfig.from_dict({"nope": 1})
    f = tmp_path / "c.toml"
    f.write_text("steps = 7\nseed = 2\n[model]\nn_layer = 2\n")
    cfg = build_config(f, steps=9, seed=None, model_n_embd=64)
    assert (cfg.steps, cfg.seed, cfg.model.n_layer, cfg.model.n_embd) == (9, 2, 2, 64)
    with pytest.raises(ConfigError, match="n_embd .* divisible"):
        ModelConfig(n_embd=10, n_head=4)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.integers(0, 10**6), world=st.integers(1, 8))
def test_batches_are_a_pure_function_of_seed_step_rank(seed, step, world):
    corpus = Corpus.embedded()
    for rank in range(world):
        a = batch_for(corpus, seed=seed, step=step, rank=rank, world_size=world, batch_size=2, seq_len=16)
        b = batch_for(corpus, seed=seed, step=step, rank=rank, world_size=world, batch_size=2, seq_len=16)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one
    if world > 1:
        r0 = batch_for(corpus, seed=seed, step=step, rank=0, world_size=world, batch_size=2, seq_len=16)[0]
        r1 = batch_for(corpus, seed=seed, step=step, rank=1, world_size=world, batch_size=2, seq_len=16)[0]
        assert not torch.equal(r0, r1)


def test_model_shapes_and_size():
    cfg = ModelConfig()
    model = build_model(cfg, VOCAB_SIZE, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 2.5e6 < n < 4e6
    x = torch.zeros(3, cfg.seq_len, dtype=torch.long)
    assert model(x).shape == (3, cfg.seq_len, VOCAB_SIZE)
    again = build_model(cfg, VOCAB_SIZE, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_fault_spec_parsing_and_errors():
    f = FaultSpec.parse("sigkill:rank=2,step=30,phase=backward")
    assert (f.kind, f.rank, f.step, f.phase) == ("sigkill", 2, 30, "backward")
    assert FaultSpec.parse(str(f)) == f
    for bad, needle in [("boom:rank=1", "unknown fault kind"), ("sigkill:rank=1,phase=lunch", "unknown fault phase"),
                        ("sigkill:rank", "expected key=value"), ("sigkill:colour=red", "unknown fault field")]:
        with pytest.raises(ValueError, match=needle):
            FaultSpec.parse(bad)


def test_chaos_schedule_is_reproducible_and_spaced():
    a = chaos_schedule("seed=4,rate=0.3", world=4, steps=100)
    assert a == chaos_schedule("seed=4,rate=0.3", world=4, steps=100)
    assert a and all(y.step - x.step >= 3 for x, y in zip(a, a[1:]))
    with pytest.raises(ValueError, match="rate"):
        chaos_schedule("rate=3", world=4, steps=10)
