"""The user's `torch.optim` optimizer, applied elementwise to slices of the flat state.

unbroken never calls `optimizer.step()`: the update is chunked, transactional and
replayable, so it runs on views of one flat parameter shard and its state. What the
user built still decides the arithmetic: the optimizer's class and every parameter
group's hyperparameters (read afresh each step, so a scheduler or the script may change
them), applied with torch's own functional optimizer ops (`torch.optim.adam.adam`, ...,
single-tensor path, the one `optimizer.step()` takes on CPU) to each run of elements
that share a group. Those ops are elementwise: a slice's new bytes depend only on its
old bytes, its gradient, the group's hyperparameters and the step number, so a chunk
can be (re)applied alone during recovery and give the bytes a failure-free run gives.

Supported: SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW (amsgrad,
decoupled or L2 weight decay), RMSprop (momentum, centered) and Adagrad (lr_decay,
initial_accumulator_value); each with `maximize`. Others (LBFGS needs closures and
line searches over the whole model; Adafactor's factored second moment is per-row and
per-column, not per element) are refused with a message naming the supported ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim import adagrad, adam, rmsprop, sgd


class UnsupportedOptimizer(ValueError):
    """The optimizer (or one of its options) has no elementwise chunked update here."""


@dataclass(frozen=True)
class _Kind:
    hyper: tuple[str, ...]        # the group keys the update reads (betas is split into beta1, beta2)
    state: Callable[[list[dict]], tuple[str, ...]]  # per-element state tensors the groups need
    apply: Callable               # apply(p, g, state, hyper, step)


def _sgd(p, g, state, h, step):
    buf = state.get("momentum_buffer")
    if buf is None and h["momentum"] != 0:
        raise UnsupportedOptimizer("SGD momentum became non-zero during training: build the optimizer with the "
                                   "momentum it will use (a scheduler may change it, but not from 0)")
    bufs = [None if (step == 1 or buf is None) else buf]  # torch's first step: buffer = gradient
    sgd.sgd([p], [g], bufs, foreach=False, fused=False, weight_decay=h["weight_decay"], momentum=h["momentum"],
            lr=h["lr"], dampening=h["dampening"], nesterov=h["nesterov"], maximize=h["maximize"])
    if h["momentum"] != 0 and step == 1:
        buf.copy_(bufs[0])


def _adam(p, g, state, h, step):
    amsgrad = h["amsgrad"]
    adam.adam([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [state["max_exp_avg_sq"]] if amsgrad else [],
              [torch.tensor(float(step - 1))], foreach=False, fused=False, capturable=False, differentiable=False,
              decoupled_weight_decay=h["decoupled_weight_decay"], amsgrad=amsgrad, beta1=h["beta1"],
              beta2=h["beta2"], lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"], maximize=h["maximize"])


def _rmsprop(p, g, state, h, step):
    unused = state["square_avg"]  # never read when the group is not centered / has no momentum
    rmsprop.rmsprop([p], [g], [state["square_avg"]], [state.get("grad_avg", unused)],
                    [state.get("momentum_buffer", unused)], [torch.tensor(float(step - 1))], foreach=False,
                    maximize=h["maximize"], differentiable=False, capturable=False, lr=h["lr"], alpha=h["alpha"],
                    eps=h["eps"], weight_decay=h["weight_decay"], momentum=h["momentum"], centered=h["centered"])


def _adagrad(p, g, state, h, step):
    adagrad.adagrad([p], [g], [state["sum"]], [torch.tensor(float(step - 1))], fused=False, foreach=False,
                    lr=h["lr"], weight_decay=h["weight_decay"], lr_decay=h["lr_decay"], eps=h["eps"],
                    maximize=h["maximize"])


def _any(groups: list[dict], key: str, test=bool) -> bool:
    return any(test(g[key]) for g in groups)


KINDS: dict[type, _Kind] = {
    torch.optim.SGD: _Kind(("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
                           lambda gs: ("momentum_buffer",) if _any(gs, "momentum") else (), _sgd),
    torch.optim.Adam: _Kind(("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize",
                             "decoupled_weight_decay"),
                            lambda gs: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if _any(gs, "amsgrad") else ()),
                            _adam),
    torch.optim.RMSprop: _Kind(("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
                               lambda gs: ("square_avg",) + (("momentum_buffer",) if _any(gs, "momentum") else ())
                               + (("grad_avg",) if _any(gs, "centered") else ()), _rmsprop),
    torch.optim.Adagrad: _Kind(("lr", "lr_decay", "weight_decay", "eps", "maximize"), lambda gs: ("sum",), _adagrad),
}
KINDS[torch.optim.AdamW] = KINDS[torch.optim.Adam]  # decoupled_weight_decay=True in its groups
SUPPORTED = "SGD, Adam, AdamW, RMSprop, Adagrad"


def _scalar(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


class ChunkOptimizer:
    """Reads a torch.optim optimizer's groups and applies its update to slices of flat tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        kind = KINDS.get(type(optimizer))
        if kind is None:
            raise UnsupportedOptimizer(
                f"unbroken cannot apply {type(optimizer).__name__} chunk by chunk (its update is not elementwise "
                f"or not known to unbroken); use one of {SUPPORTED} from torch.optim")
        for i, g in enumerate(optimizer.param_groups):
            if g.get("differentiable"):
                raise UnsupportedOptimizer(f"param group {i}: differentiable=True is not supported; build the "
                                           "optimizer with differentiable=False")
        self.optimizer, self.kind = optimizer, kind
        self.name = type(optimizer).__name__
        self.n_groups = len(optimizer.param_groups)
        self.state_names: tuple[str, ...] = kind.state(self.hyper_now())

    def hyper_now(self) -> list[dict]:
        """Every group's hyperparameters as they are now (plain floats and bools: JSON-able)."""
        groups = self.optimizer.param_groups
        if len(groups) != self.n_groups:
            raise UnsupportedOptimizer(f"the optimizer had {self.n_groups} param groups and now has {len(groups)}: "
                                       "unbroken cannot add or remove param groups during training")
        out = []
        for g in groups:
            flat = dict(g)
            if "betas" in flat:
                flat["beta1"], flat["beta2"] = flat["betas"]
            out.append({k: _scalar(flat[k]) for k in self.kind.hyper})
        return out

    def initial_value(self, name: str, group: int) -> float:
        """The value a fresh state tensor starts from (Adagrad's initial_accumulator_value)."""
        if name == "sum":
            return float(self.optimizer.param_groups[group].get("initial_accumulator_value", 0.0))
        return 0.0

    def apply(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict,
              step: int) -> None:
        """One step of the optimizer on a slice: p and its state in place, g read only."""
        self.kind.apply(p, g, state, hyper, step)

    def has_state(self) -> bool:
        """True when the optimizer already holds per-parameter state beyond a fresh one's
        (e.g. loaded from a snapshot): unbroken's own state would silently replace it."""
        for st in self.optimizer.state.values():
            step = st.get("step")
            if set(st) - {"step", "sum"} or (step is not None and float(step) != 0):
                return True
        return False
