"""Random-weight replicas of table models: the table's config fields, and the LLaMA fallback's MLP width."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from unbroken.predict import replica
from unbroken.predict.tables import ModelSpec, SpecError, load_models


def _llama_params(f: dict) -> float:
    h, layers, heads, kv, width = (f["hidden_size"], f["num_hidden_layers"], f["num_attention_heads"],
                                   f["num_key_value_heads"], f["intermediate_size"])
    return 2 * f["vocab_size"] * h + layers * (2 * h * h + 2 * h * (h // heads) * kv + 3 * h * width)


def test_a_wattgpu_row_gives_its_config_fields():
    model_type, f = replica.config_fields(load_models().get("meta-llama/Llama-2-13b-chat-hf"))
    assert model_type == "llama"
    assert (f["num_hidden_layers"], f["hidden_size"], f["intermediate_size"], f["vocab_size"]) == (40, 5120, 13824, 32000)
    assert f["tie_word_embeddings"] is False and isinstance(f["num_attention_heads"], int)


def test_our_rows_fall_back_to_llama_with_its_real_mlp_width():
    model_type, f = replica.config_fields(load_models().get("metaai/llama-7B"))
    assert model_type == "llama" and f["intermediate_size"] == 11008  # LLaMA-7B's published width


@pytest.mark.parametrize("name", ["metaai/llama-7B", "meta-llama/Meta-Llama-3.1-8B-Instruct",
                                  "mistralai/Mistral-7B-Instruct-v0.3", "openai-community/gpt2"])
def test_replicas_have_the_tables_parameter_count(name):
    spec = load_models().get(name)
    model = replica.build(spec, "meta", torch.float16)  # shapes only: no memory, no time
    assert replica.parameter_count(model) == pytest.approx(spec.total_b_params, rel=0.01)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(8, 96), h_heads=st.sampled_from([(2048, 16), (4096, 32), (5120, 40), (8192, 64)]),
       kv_div=st.sampled_from([1, 4, 8]), mlp_ratio=st.floats(2.0, 4.0))
def test_the_solved_mlp_width_reproduces_the_parameter_count(layers, h_heads, kv_div, mlp_ratio):
    h, heads = h_heads
    truth = {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": heads // kv_div, "intermediate_size": int(mlp_ratio * h) // 256 * 256,
             "vocab_size": replica.LLAMA_VOCAB}
    spec = ModelSpec(name="x/y", total_b_params=_llama_params(truth) / 1e9, active_b_params=float("nan"),
                     num_layers=layers, hidden_size=h, num_attention_heads=heads,
                     num_key_value_heads=heads // kv_div)
    assert replica.llama_fields(spec) == truth


def test_too_few_parameters_for_the_shape_is_a_spec_error():
    spec = ModelSpec(name="x/tiny", total_b_params=0.1, active_b_params=0.1, num_layers=32, hidden_size=4096,
                     num_attention_heads=32, num_key_value_heads=32)
    with pytest.raises(SpecError, match="total_b_params"):
        replica.llama_fields(spec)
