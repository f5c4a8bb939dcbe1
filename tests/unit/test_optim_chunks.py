"""The chunked update of a user's torch.optim optimizer is bitwise what optimizer.step() gives.

The same parameters, the same gradients, the same param groups and scheduler: one copy is
stepped by torch.optim itself, the other by unbroken's OwnedState chunk by chunk (chunks
small enough to cut through parameters and param groups, each in two halves), for several
steps; parameters and every state tensor must be equal bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.parallel.buffers import ModelBuffers
from unbroken.parallel.optim import ChunkOptimizer, UnsupportedOptimizer
from unbroken.parallel.schedule import ScheduleClock, ScheduleError
from unbroken.parallel.strategy import OwnedState
from unbroken.protect.txn import StepScalars
from unbroken.runtime.adopt import AdoptionError, trained_parameters

OPTIMIZERS = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.05),
    "sgd_momentum": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "sgd_nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=1e-2),
    "adam_amsgrad": lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True, maximize=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-2),
    "adamw_amsgrad": lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.95), amsgrad=True),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-2, weight_decay=1e-3),
    "rmsprop_centered_momentum": lambda g: torch.optim.RMSprop(g, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
}
SCHEDULERS = {
    "none": None,
    "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(  # cycles momentum / beta1 where there is one
        o, max_lr=0.05, total_steps=10, cycle_momentum="momentum" in o.defaults or "betas" in o.defaults),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(7, 5, generator=g))
        self.b1 = nn.Parameter(torch.randn(5, generator=g))
        self.frozen = nn.Parameter(torch.randn(4, generator=g), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(13, generator=g))
        self.register_buffer("running", torch.zeros(3))


def groups_of(model: Net) -> list[dict]:
    """Decay / no-decay groups, nanoGPT style, with a per-group lr."""
    return [{"params": [model.w1, model.w2], "weight_decay": 0.1},
            {"params": [model.b1, model.frozen], "weight_decay": 0.0, "lr": 0.02}]


def grads_for(step: int, model: Net) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if p.requires_grad}


def reference(opt_name: str, sched_name: str, steps: int) -> tuple[Net, torch.optim.Optimizer]:
    model = Net()
    opt = OPTIMIZERS[opt_name](groups_of(model))
    sched = SCHEDULERS[sched_name](opt) if SCHEDULERS[sched_name] else None
    for t in range(1, steps + 1):
        for n, g in grads_for(t, model).items():
            getattr(model, n).grad = g
        opt.step()
        if sched is not None:
            sched.step()
    return model, opt


def chunked(opt_name: str, sched_name: str, steps: int, chunk_elems: int) -> tuple[Net, OwnedState]:
    model = Net()
    opt = OPTIMIZERS[opt_name](groups_of(model))
    sched = SCHEDULERS[sched_name](opt) if SCHEDULERS[sched_name] else None
    named, group_of = trained_parameters(model, opt)
    chunk_opt = ChunkOptimizer(opt)
    clock = ScheduleClock(chunk_opt, sched)
    owned = OwnedState(named, group_of, chunk_opt, ModelBuffers(model), strategy="zero1", rank=0, world=1,
                       group_size=1, chunk_elems=chunk_elems)
    flat = owned.flat
    for t in range(1, steps + 1):
        grads = flat.use_grads_of(t)
        grads.zero_()
        off = 0
        for n, p in named:
            grads[off:off + p.numel()] = grads_for(t, model)[n].reshape(-1)
            off += p.numel()
        s = StepScalars(step=t, groups=tuple(clock.hyper_for(t)))
        owned.txn.begin(s)
        for c in range(owned.state.n_chunks):
            owned.apply_chunk(c, s, point=lambda phase, c: None)
    return model, owned


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@settings(max_examples=25, deadline=None)
@given(opt_name=st.sampled_from(sorted(OPTIMIZERS)), sched_name=st.sampled_from(sorted(SCHEDULERS)),
       chunk_elems=st.sampled_from([16, 32, 48, 112]), steps=st.integers(1, 6))
def test_chunked_update_is_bitwise_torch_optim(opt_name, sched_name, chunk_elems, steps):
    ref_model, ref_opt = reference(opt_name, sched_name, steps)
    model, owned = chunked(opt_name, sched_name, steps, chunk_elems)
    for (n, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert _same(p.detach(), q.detach()), f"{opt_name}/{sched_name}: parameter {n} differs"
    off = 0
    for n, p in ref_model.named_parameters():
        if not p.requires_grad:
            continue
        for name, t in owned.opt_state.items():
            mine = t[off:off + p.numel()].view(p.shape)
            theirs = ref_opt.state[p].get(name)
            if theirs is None:  # a group that does not use this tensor (e.g. no momentum)
                continue
            assert _same(mine, theirs), f"{opt_name}/{sched_name}: state {name} of {n} differs"
        off += p.numel()


def test_clipped_step_matches_clip_grad_norm_up_to_rounding():
    """The clip coefficient is computed from the flat norm: equal to clip_grad_norm_'s within float rounding."""
    ref_model = Net()
    for n, g in grads_for(1, ref_model).items():
        getattr(ref_model, n).grad = g
    before = [p.grad.clone() for p in ref_model.parameters() if p.requires_grad]
    total = torch.nn.utils.clip_grad_norm_([p for p in ref_model.parameters() if p.requires_grad], 1.0)
    flat_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before])))
    assert abs(flat_norm - float(total)) <= 1e-5 * flat_norm


def test_unsupported_optimizer_is_refused_naming_the_supported_ones():
    model = Net()
    with pytest.raises(UnsupportedOptimizer, match="SGD, Adam, AdamW, RMSprop, Adagrad"):
        ChunkOptimizer(torch.optim.LBFGS([model.w1]))
    with pytest.raises(UnsupportedOptimizer, match="differentiable"):
        ChunkOptimizer(torch.optim.SGD([model.w1], lr=0.1, differentiable=True))


def test_foreign_parameters_and_foreign_schedulers_are_refused():
    model, other = Net(), Net()
    with pytest.raises(AdoptionError, match="not parameters of the model"):
        trained_parameters(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(AdoptionError, match="pass the torch.optim optimizer"):
        trained_parameters(model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ScheduleError, match="another optimizer"):
        ScheduleClock(ChunkOptimizer(opt), torch.optim.lr_scheduler.StepLR(other_opt, 1))
    with pytest.raises(ScheduleError, match="metric"):
        ScheduleClock(ChunkOptimizer(opt), torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


def test_an_attached_scheduler_must_be_handed_over_and_not_stepped_by_the_script():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with pytest.raises(ScheduleError, match="pass it as unbroken.Trainer"):
        ScheduleClock(ChunkOptimizer(opt), None)
    clock = ScheduleClock(ChunkOptimizer(opt), sched)
    assert clock.hyper_for(3)[0]["lr"] == pytest.approx(0.025)
    done, refused = [0], []
    clock.started_at(0, lambda: done[0], refused.append)
    done[0] = 1
    sched.step()  # the script's call after step 1: a no-op, on cadence
    assert clock.hyper_for(3)[0]["lr"] == pytest.approx(0.025) and not refused
    done[0] = 5
    sched.step()  # its second call after 5 steps: a per-epoch loop told unbroken "step"
    assert refused and "scheduler_step='epoch'" in refused[0]
    type(sched).step(sched)  # stepped behind unbroken's back
    with pytest.raises(ScheduleError, match="leave it alone"):
        clock.hyper_for(9)


def test_schedule_rewinds_and_a_late_joiner_agrees():
    """A rollback past the cache and a process that joins at step 40 read the same values."""
    def make():
        model = Net()
        opt = torch.optim.AdamW(groups_of(model), lr=1e-2)
        return ScheduleClock(ChunkOptimizer(opt), torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50))

    a, b = make(), make()
    seen = {t: copy.deepcopy(a.hyper_for(t)) for t in range(1, 61)}
    a._cache.clear()
    assert a.hyper_for(7) == seen[7]  # rewound from the initial state
    b.move_to(40)
    assert b.hyper_for(40) == seen[40]


def test_optimizer_with_loaded_state_is_detected():
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    assert not ChunkOptimizer(opt).has_state()
    model.w1.grad = torch.ones_like(model.w1)
    opt.step()
    assert ChunkOptimizer(opt).has_state()
    assert not ChunkOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1)).has_state()
