"""One training script, two launchers: torchrun (plain DDP) or `unbroken run` (chosen by UNBROKEN_RUN_DIR).

    --optimizer NAME   one of OPTIMIZERS: param groups (decay / no-decay, a per-group lr), a
                       scheduler per optimizer, a BatchNorm (buffers), a frozen parameter
    --out FILE         rank 0 writes {"losses": [...]} (plain: the rank-averaged loss per step)
    --weights FILE     rank 0 saves the final state_dict (plain; unbroken writes weights.pt itself)
    --stateful-data    read batches from a plain Python iterator advanced per step (not replayable:
                       a redo after a rollback sees other batches; unbroken must say so)
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

OPTIMIZERS = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.05),
    "sgd_nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=1e-3),
    "adamw_amsgrad": lambda g: torch.optim.AdamW(g, lr=1e-2, amsgrad=True),
    "rmsprop_centered": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
}
SCHEDULERS = {
    "sgd_nesterov": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=16),  # cycles momentum
    "adamw_amsgrad": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=16),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32, bias=False)  # BatchNorm follows: a bias there would get pure-noise gradients
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 1)
        self.scale = nn.Parameter(torch.full((1,), 0.5), requires_grad=False)  # frozen

    def forward(self, x):
        return self.out(F.relu(self.bn(self.inp(x)))) * self.scale


def groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]


def dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, (x[:, :1] * 2 - x[:, 1:2]).tanh())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--stateful-data", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[args.optimizer](groups(model))
    sched = SCHEDULERS.get(args.optimizer, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5))(opt)
    data = dataset()
    losses = []
    if os.environ.get("UNBROKEN_RUN_DIR"):
        import unbroken

        trainer = unbroken.Trainer(model, opt, sched)
        loader = trainer.loader(data, batch_size=8)
        stream = iter([loader.batch(s) for s in range(1, 17)])  # a stateful iterator unbroken cannot see
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                if args.stateful_data:
                    x, y = next(stream)
                losses.append(trainer.step(lambda: F.mse_loss(model(x), y)))
        rank = trainer.rank
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(data)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(data, batch_size=8, sampler=sampler):
                opt.zero_grad()
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                sched.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(float(mean) / world)
        if rank == 0:
            if args.weights:
                torch.save(model.state_dict(), args.weights)
            write_losses(args.out, losses)
        dist.barrier()
        # Leave without interpreter teardown: torch's gloo teardown can deadlock. Dropping the
        # last reference to the process group (DDP's Reducer, freed when main returns) runs
        # ProcessGroupGloo's destructor under the GIL, and it joins a gloo worker thread that
        # is waiting for the GIL to free a finished work's tensors (seen under pytest: one rank
        # of four hung there for minutes after writing its results).
        sys.stdout.flush()
        os._exit(0)
    if rank == 0:
        write_losses(args.out, losses)


def write_losses(path, losses):
    with open(path, "w") as f:
        json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
