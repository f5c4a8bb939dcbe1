"""A DDP training script in the style of PyTorch's DDP tutorial series (multigpu_torchrun.py).

    torchrun --nproc-per-node 4 examples/tutorial_ddp.py --epochs 3      # plain PyTorch
    unbroken run --world-size 4 examples/tutorial_unbroken.py --epochs 3  # the port of this script

Model, Dataset + DistributedSampler + DataLoader, SGD with momentum, a StepLR stepped per
epoch, a snapshot for resuming (harmless under unbroken: a process that joins later gets the
recovered weights instead).
"""
import argparse
import os

import torch
import torch.nn.functional as F
import unbroken
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RegressionDataset(Dataset):
    def __init__(self, size: int):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.rand(size, 20, generator=g)
        self.y = torch.sin(self.x @ torch.linspace(-2, 2, 20).unsqueeze(1)) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, dataset, optimizer, scheduler, batch_size, snapshot_path):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = unbroken.Trainer(self.model, self.optimizer, self.scheduler, scheduler_step="epoch")
        self.rank = int(os.environ["RANK"])
        self.train_data = self.model.loader(dataset, batch_size=batch_size)
        self.losses = []

    def _load_snapshot(self, path):
        snapshot = torch.load(path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = self.model.step(lambda: F.mse_loss(self.model(source), targets))
        self.optimizer.step()
        self.losses.append(loss.item() if torch.is_tensor(loss) else loss)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        self.scheduler.step()

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)
    dataset = RegressionDataset(512)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return dataset, model, optimizer, scheduler


def main(epochs, batch_size, snapshot_path):
    ddp_setup()
    dataset, model, optimizer, scheduler = load_train_objs()
    trainer = Trainer(model, dataset, optimizer, scheduler, batch_size, snapshot_path)
    trainer.train(epochs)
    destroy_process_group()
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a DDP training job")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--snapshot", default="snapshot.pt")
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.snapshot)
