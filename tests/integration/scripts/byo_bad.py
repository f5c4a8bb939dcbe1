"""A script that misuses unbroken.Trainer in one way per flag (tests/integration/test_byo.py)."""
import sys

import torch
from torch.utils.data import TensorDataset

import unbroken

flag = sys.argv[1]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if flag == "--no-optimizer":
    trainer = unbroken.Trainer(model)
elif flag == "--foreign-optimizer":
    trainer = unbroken.Trainer(model, torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
elif flag == "--foreign-scheduler":
    other = torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1)
    trainer = unbroken.Trainer(model, opt, torch.optim.lr_scheduler.StepLR(other, 1))
elif flag == "--accumulation-steps=0":
    trainer = unbroken.Trainer(model, opt, accumulation_steps=0)
elif flag == "--meta-model":  # not on this rank's device: refused, never moved behind the script's back
    meta = torch.nn.Linear(4, 1, device="meta")
    trainer = unbroken.Trainer(meta, torch.optim.SGD(meta.parameters(), lr=0.1))
elif flag == "--lbfgs":
    trainer = unbroken.Trainer(model, torch.optim.LBFGS(model.parameters()))
else:
    trainer = unbroken.Trainer(model, opt)
n = 6 if flag == "--tiny-dataset" else 64
loader = trainer.loader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=4)
for step in trainer.steps(5 if flag == "--steps-disagree" else 2):
    x, y = loader.batch(step)
    trainer.step(lambda: torch.nn.functional.mse_loss(model(x), y))
