"""The built-in job: the tiny char-level GPT on the embedded corpus, under unbroken."""
from __future__ import annotations

import unbroken
from unbroken.jobs.recipe import default_training
from unbroken.models import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model


def main() -> None:
    cfg = unbroken.current_config()
    device = unbroken.device()
    model = build_model(cfg.model, VOCAB_SIZE, seed=cfg.seed).to(device)
    optimizer, scheduler, clip = default_training(model, cfg)
    trainer = unbroken.Trainer(model, optimizer, scheduler, grad_clip=clip)  # a shadow waits here for a rank
    corpus = Corpus.embedded()
    for step in trainer.steps():
        x, y = batch_for(corpus, seed=cfg.seed, step=step, rank=trainer.rank, world_size=trainer.world_size,
                         batch_size=cfg.batch_size, seq_len=cfg.model.seq_len)
        x, y = x.to(device), y.to(device)
        trainer.step(lambda: model.loss(x, y))
    trainer.finish()


if __name__ == "__main__":
    main()
