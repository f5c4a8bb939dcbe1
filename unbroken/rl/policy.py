"""The policy: our TinyGPT over the task's vocabulary; sampling with a KV cache until EOS or a cap
(finished rows leave the batch, so a batch costs as much as its longest completion); per-token
log-probabilities for training; and the brief supervised pre-training that makes it partly right."""
from __future__ import annotations

import io
import random

import torch
import torch.nn.functional as F

from unbroken.config import ModelConfig
from unbroken.models.gpt import TinyGPT, build_model
from unbroken.rl import task
from unbroken.rl.config import RLConfig


def state_bytes(state: dict) -> bytes:
    """A state_dict as torch.save bytes (what travels between the processes)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_state(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def model_config(cfg: RLConfig) -> ModelConfig:
    seq = task.prompt_len(cfg.digits) + task.max_new_tokens(cfg.digits, cfg.max_repeat)
    return ModelConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, seq_len=seq)


def new_policy(cfg: RLConfig) -> TinyGPT:
    return build_model(model_config(cfg), task.VOCAB, cfg.seed)


def _block(blk, x: torch.Tensor, cache: tuple | None) -> tuple[torch.Tensor, tuple]:
    """One transformer block over the new positions `x`, attending to the cached keys/values too."""
    b, t, c = x.shape
    h = blk.n_head
    q, k, v = blk.qkv(blk.ln1(x)).split(c, dim=2)
    q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and t > 1)
    x = x + blk.proj(y.transpose(1, 2).reshape(b, t, c))
    return x + blk.mlp(blk.ln2(x)), (k, v)


def _forward_cached(model: TinyGPT, ids: torch.Tensor, start: int, caches: list | None):
    """Logits of the last position of `ids` (placed at positions start..), and the grown caches."""
    x = model.tok(ids) + model.pos(torch.arange(start, start + ids.shape[1]))
    new = []
    for i, blk in enumerate(model.blocks):
        x, kv = _block(blk, x, None if caches is None else caches[i])
        new.append(kv)
    return model.ln_f(x[:, -1]) @ model.tok.weight.T, new


@torch.no_grad()
def cached_logits(model: TinyGPT, idx: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits at positions prefill-1.. of `idx`, prefilling `prefill` tokens then one token at a time
    through the KV cache (tests compare it with the full forward)."""
    logits, caches = _forward_cached(model, idx[:, :prefill], 0, None)
    out = [logits]
    for t in range(prefill, idx.shape[1]):
        logits, caches = _forward_cached(model, idx[:, t:t + 1], t, caches)
        out.append(logits)
    return torch.stack(out, dim=1)


@torch.no_grad()
def sample(model: TinyGPT, prompts: list[str], max_new: int, temperature: float,
           gen: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """Sample a completion for every prompt (equal lengths): (token ids, ending with EOS unless the
    cap was hit; the sampling policy's log-probability of each token)."""
    ids = torch.tensor([task.encode(p) for p in prompts])
    plen = ids.shape[1]
    logits, caches = _forward_cached(model, ids, 0, None)
    alive = torch.arange(len(prompts))
    toks: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    for i in range(max_new):
        logp = F.log_softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        chosen = logp.gather(1, nxt).squeeze(1)
        for row, t, lp in zip(alive.tolist(), nxt.squeeze(1).tolist(), chosen.tolist()):
            toks[row].append(t)
            lps[row].append(lp)
        keep = nxt.squeeze(1) != task.EOS
        if i == max_new - 1 or not bool(keep.any()):
            break
        alive, nxt = alive[keep], nxt[keep]
        caches = [(k[keep], v[keep]) for k, v in caches]
        logits, caches = _forward_cached(model, nxt, plen + i, caches)
    return list(zip(toks, lps))


def token_logprobs(model: TinyGPT, prompts: list[str], completions: list[list[int]],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token) of every completion token (N, L) and its mask (N, L), L the longest completion."""
    plen, width = len(prompts[0]), max(len(c) for c in completions)
    idx = torch.full((len(prompts), plen + width), task.PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        idx[i, :plen] = torch.tensor(task.encode(p))
        idx[i, plen:plen + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, :len(c)] = 1.0
    logits = model(idx[:, :-1])[:, plen - 1:] / temperature
    return F.log_softmax(logits, dim=-1).gather(2, idx[:, plen:, None]).squeeze(2), mask


def _noisy_answer(rng: random.Random, p: task.Prompt, cfg: RLConfig) -> str:
    """The supervised data's label noise: with probability cfg.pretrain_noise the answer is repeated a
    random number of times (1..max_repeat) instead of the k asked for, so the warm-started policy
    gets the sum mostly right and the repeat count only partly: what RL with the verifier fixes."""
    if rng.random() >= cfg.pretrain_noise:
        return p.answer
    one = p.answer.split(",")[0]
    return ",".join([one] * rng.randint(1, cfg.max_repeat))


def pretrain(cfg: RLConfig) -> dict:
    """Supervised warm start: `pretrain_steps` Adam steps of next-token loss on the (noisy) answers of
    random prompts (the same distribution RL sees); deterministic in cfg.seed. Returns the state_dict."""
    model = new_policy(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.pretrain_lr)
    rng = random.Random(f"rl-pretrain/{cfg.seed}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for _ in range(cfg.pretrain_steps):
            ps = [task.make_prompt(rng, cfg.digits, cfg.lengths, cfg.max_repeat) for _ in range(cfg.pretrain_batch)]
            answers = [_noisy_answer(rng, p, cfg) for p in ps]
            lp, mask = token_logprobs(model, [p.text for p in ps], [task.encode(a + ";") for a in answers], 1.0)
            loss = -(lp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.state_dict()
