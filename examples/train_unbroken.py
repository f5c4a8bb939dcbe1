"""The DDP script of train_ddp.py under unbroken (run with: unbroken run --world-size 4 examples/train_unbroken.py).

A rank that dies is replaced in place; the loop never sees it. Changed lines are marked.
"""
import torch

import unbroken  # changed
from unbroken.config import ModelConfig
from unbroken.models import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model


def main() -> None:
    model = build_model(ModelConfig(n_layer=2, n_embd=64), VOCAB_SIZE, seed=0)
    trainer = unbroken.Trainer(model)  # changed: replaces init_process_group, DDP and the optimizer
    rank, world = trainer.rank, trainer.world_size  # changed
    corpus = Corpus.embedded()
    for step in trainer.steps(20):  # changed: step numbers continue across recoveries
        x, y = batch_for(corpus, seed=0, step=step, rank=rank, world_size=world, batch_size=4, seq_len=64)

        def loss_fn():  # changed: the forward pass, as a closure unbroken may redo
            logits = model(x)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        trainer.step(loss_fn)  # changed: replaces zero_grad / backward / step
    trainer.finish()  # changed: final weights, atomically, with checksum


if __name__ == "__main__":
    main()
