"""A nanoGPT-style training script (after karpathy/nanoGPT's train.py, reduced to CPU and gloo).

    torchrun --nproc-per-node 4 examples/nanogpt_ddp.py --out ckpt.pt        # plain PyTorch
    unbroken run --world-size 4 examples/nanogpt_unbroken.py --out ckpt.pt   # the port of this script

A GPT whose token embedding and output head share one weight, dropout, AdamW with decay and
no-decay parameter groups, a warm-up + cosine learning rate set by hand every iteration,
gradient accumulation, global-norm clipping, optional bf16 autocast. Batches are drawn from
a generator seeded by (iteration, micro-step, rank), so a plain run and an unbroken run see
the same data.
"""
import argparse
import contextlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import unbroken
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters. ") * 8


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_lr(it, args):
    if it <= args.warmup_iters:
        return args.learning_rate * it / args.warmup_iters
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)


def get_batch(data, it, micro, rank, args):
    g = torch.Generator().manual_seed(100_000 * it + 100 * micro + rank)
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,), generator=g)
    x = torch.stack([data[i:i + args.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix])
    return x, y


def parse_args():
    p = argparse.ArgumentParser(description="nanoGPT-style training")
    p.add_argument("--max-iters", type=int, default=12)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default="ckpt.pt")
    return p.parse_args()


def main():
    args = parse_args()
    init_process_group(backend="gloo")
    torch.manual_seed(1337)
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    model = GPT(block_size=args.block_size, dropout=args.dropout)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (0.9, 0.95))
    model = unbroken.Trainer(model, optimizer, grad_clip=args.grad_clip, accumulation_steps=args.accum)
    rank = int(os.environ["RANK"])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    for it in model.steps(args.max_iters):
        lr = get_lr(it, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        def micro_loss(micro):
            model.require_backward_grad_sync = micro == args.accum - 1
            x, y = get_batch(data, it, micro, rank, args)
            with ctx:
                _, loss = model(x, y)
            loss = loss / args.accum
            return loss
        model.step(micro_loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    destroy_process_group()


if __name__ == "__main__":
    main()
