"""A user's script with a bug at one step: `--bug nan` makes step 3's loss NaN on every
attempt (the same batch always overflows); `--bug keyerror` raises KeyError at step 3 on
rank 1 (a deterministic bug in the script). Otherwise a plain unbroken script."""
import argparse

import torch

import unbroken
from unbroken.config import ModelConfig
from unbroken.models import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bug", choices=["nan", "keyerror"], required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    model = build_model(ModelConfig(n_layer=2, n_embd=64), VOCAB_SIZE, seed=0)
    trainer = unbroken.Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    corpus = Corpus.embedded()
    lookup = {"ok": 1}
    for step in trainer.steps(args.steps):
        x, y = batch_for(corpus, seed=0, step=step, rank=trainer.rank, world_size=trainer.world_size,
                         batch_size=4, seq_len=64)
        if args.bug == "keyerror" and step == 3 and trainer.rank == 1:
            lookup["missing"]  # noqa: B018 - the bug under test

        def loss_fn():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            return loss * float("nan") if (args.bug == "nan" and step == 3) else loss

        trainer.step(loss_fn)
    trainer.finish()


if __name__ == "__main__":
    main()
