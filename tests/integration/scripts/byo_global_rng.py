"""A script written the way users write them, under unbroken: batches from the *global* RNG
(nanoGPT's get_batch: torch.randint without a generator), dropout, an embedding tied to the
output head, a frozen parameter, bf16 autocast, gradient accumulation and clipping, numpy
noise from its global generator. Run with kills, the final weights must equal a failure-free
run's bit for bit (tests/integration/test_byo.py)."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import unbroken

VOCAB, T = 64, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.zeros(T, 32), requires_grad=False)  # frozen
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(self.mlp(self.emb(idx) + self.pos))


data = torch.arange(4000) % VOCAB
model = TinyLM()
opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad and p.dim() >= 2],
                          "weight_decay": 0.1},
                         {"params": [p for p in model.parameters() if p.requires_grad and p.dim() < 2],
                          "weight_decay": 0.0}], lr=3e-3)
trainer = unbroken.Trainer(model, opt, torch.optim.lr_scheduler.StepLR(opt, 5, 0.5), grad_clip=0.5,
                           accumulation_steps=2)


def get_batch():
    ix = torch.randint(len(data) - T - 1, (4,))  # the global generator, as nanoGPT does
    jitter = int(np.random.randint(0, 2))  # and numpy's
    x = torch.stack([data[i + jitter:i + jitter + T] for i in ix])
    y = torch.stack([data[i + jitter + 1:i + jitter + 1 + T] for i in ix])
    return x, y


for step in trainer.steps(12):
    def micro_loss(micro):
        x, y = get_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1)) / 2
    trainer.step(micro_loss)
