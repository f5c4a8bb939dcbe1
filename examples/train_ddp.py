"""A plain PyTorch DDP training script (run with: torchrun --nproc-per-node 4 examples/train_ddp.py).

Compare with train_unbroken.py: the same job under unbroken, 8 lines changed.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.config import ModelConfig
from unbroken.models import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import build_model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(ModelConfig(n_layer=2, n_embd=64), VOCAB_SIZE, seed=0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = Corpus.embedded()
    for step in range(1, 21):
        x, y = batch_for(corpus, seed=0, step=step, rank=rank, world_size=world, batch_size=4, seq_len=64)
        opt.zero_grad()
        logits = ddp(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
