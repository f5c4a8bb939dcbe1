"""The split model: a client segment (first layer, on the clients) and a server segment (the
rest), and one split step: clients send activations, the server returns their gradient."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SplitMLP(nn.Module):
    """client: Linear(d, h) + ReLU; server: Linear(h, h) + ReLU + Linear(h, classes)."""

    def __init__(self, n_features: int, n_classes: int, hidden: int) -> None:
        super().__init__()
        self.client = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU())
        self.server = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.server(self.client(x))


def build(n_features: int, n_classes: int, hidden: int, seed: int) -> SplitMLP:
    """The same initial weights everywhere for a given seed."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SplitMLP(n_features, n_classes, hidden)


def split_step(model: SplitMLP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step of split learning. The clients of the batch share the client segment, so their
    forwards run as one tensor; the client segment's gradient is then the sample-weighted sum
    of the per-client gradients the server's aggregation would form."""
    opt.zero_grad(set_to_none=True)
    smashed = model.client(x)                      # on the clients
    sent = smashed.detach().requires_grad_()       # what crosses the wire
    loss = F.cross_entropy(model.server(sent), y)  # on the server
    loss.backward()                                # server segment's gradient and d loss / d activations
    smashed.backward(sent.grad)                    # returned to the clients: their segment's backward
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> float:
    """Top-1 accuracy on (x, y)."""
    hits = sum(int((model(x[i:i + chunk]).argmax(1) == y[i:i + chunk]).sum()) for i in range(0, len(y), chunk))
    return hits / len(y)
