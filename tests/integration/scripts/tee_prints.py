"""A user's script that prints: `hello from rank R step S` every step, a last line without
a newline (`bye from rank R`), and with `--raise-at S` a ValueError on rank 0 at step S
(every time: the second occurrence stops the job with its traceback)."""
import argparse

import torch
import torch.nn.functional as F

import unbroken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--raise-at", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    trainer = unbroken.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for step in trainer.steps():
        print(f"hello from rank {trainer.rank} step {step}")
        if step == args.raise_at and trainer.rank == 0:
            raise ValueError(f"bad value at step {step}")
        x = torch.randn(4, 8)
        trainer.step(lambda: F.mse_loss(model(x), x[:, :1]))
    trainer.finish()
    print(f"bye from rank {trainer.rank}", end="")


if __name__ == "__main__":
    main()
