"""Random-weight stand-ins for models in the spec tables, built with Hugging Face transformers.

`unbroken predict profile --like NAME` measures a model nobody downloaded: decode time and
power depend on a model's shapes (layers, widths, heads, vocabulary), not on its weights'
values, and the WattGPU model table keeps each model's config.json fields. A row of ours
(`model_specs_extra.csv`) has only parameters, layers, hidden size and heads; it is built as a
LLaMA-architecture decoder with a 32,000-token vocabulary and the MLP width solved so that the
parameter count matches the row (LLaMA-7B: 11,008, its real width). The timing follows
ML.ENERGY's 2023 protocol (transformers' `generate`, greedy): inter-token latency is the whole
request's time divided by the tokens generated, prefill included.
"""
from __future__ import annotations

import time
from typing import Any

from unbroken.predict.tables import SpecError, config_row

# config.json fields the WattGPU table keeps that shape the computation (the rest are defaults)
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "n_embd", "n_layer", "n_head",
                "n_inner", "n_positions", "activation_function", "layer_norm_epsilon")
LLAMA_VOCAB = 32000


def _value(s: str) -> Any:
    s = s.strip()
    if s.upper() in ("TRUE", "FALSE"):
        return s.upper() == "TRUE"
    try:
        v = float(s)
    except ValueError:
        return s
    return int(v) if v.is_integer() and abs(v) < 1e9 else v


def config_fields(spec) -> tuple[str, dict[str, Any]]:
    """(model_type, config keyword arguments) for the table model `spec`."""
    r = config_row(spec.name)
    if r is None:
        return "llama", llama_fields(spec)
    return r["model_type"].strip(), {k: _value(r[k]) for k in SHAPE_FIELDS if (r.get(k) or "").strip() not in ("", "N/A")}


def llama_fields(spec) -> dict[str, Any]:
    """A LLaMA decoder with `spec`'s layers, width and heads; MLP width solved from the parameter count.

    params = 2·V·h (embeddings, untied) + L·(2·h² + 2·h·kv·h/heads + 3·h·I), I rounded to 256.
    """
    h, layers = int(spec.hidden_size), int(spec.num_layers)
    heads, kv = int(spec.num_attention_heads), int(spec.num_key_value_heads)
    attn = 2 * h * h + 2 * h * (h // heads) * kv
    mlp = (spec.total_b_params * 1e9 - 2 * LLAMA_VOCAB * h) / layers - attn
    width = int(round(mlp / (3 * h) / 256)) * 256
    if width <= 0:
        raise SpecError(f"model {spec.name!r}: {spec.total_b_params}B parameters is too few for {layers} layers "
                        f"of width {h}; check the row's total_b_params")
    return {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": width, "vocab_size": LLAMA_VOCAB}


def build(spec, device, dtype):
    """The random-weight transformers model of `spec`, on `device` in `dtype`, in eval mode."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise SpecError("--like needs Hugging Face transformers: pip install transformers") from None
    model_type, fields = config_fields(spec)
    try:
        cfg = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as e:
        raise SpecError(f"model {spec.name!r}: transformers cannot build model_type {model_type!r} ({e}); "
                        f"pick a model of a type it knows (llama, mistral, qwen2, gpt2, ...)") from None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def time_generate(model, batch: int, prompt_tokens: int, output_tokens: int, device) -> float:
    """Seconds per generated token of one greedy `generate` call (prefill included), after a warm-up."""
    import torch
    from transformers import GenerationConfig

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, prompt_tokens), generator=g).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def run(n: int) -> float:
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        sync()
        if out.shape[1] != prompt_tokens + n:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt_tokens} tokens, asked for {n}")
        return time.perf_counter() - t0

    run(min(4, output_tokens))  # kernels, allocator, caches
    return run(output_tokens) / output_tokens


def parameter_count(model) -> float:
    """Billions of parameters, to print beside the table's figure."""
    return sum(p.numel() for p in model.parameters()) / 1e9
