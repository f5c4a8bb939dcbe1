"""What `Trainer` takes from the user's objects, and the checks that make misuse a clear error.

The trained parameters are the model's parameters that require grad and that the
optimizer updates, in the model's registration order (tied weights appear once); each
belongs to one of the optimizer's param groups. A frozen parameter, or one the
optimizer does not hold, is left exactly as it is, as torch.optim would leave it.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class AdoptionError(ValueError):
    """An argument to Trainer is wrong; the message names it and the fix."""


def trained_parameters(model: nn.Module, optimizer) -> tuple[list[tuple[str, nn.Parameter]], list[int]]:
    """(named trained parameters, param group of each)."""
    if not isinstance(model, nn.Module):
        raise AdoptionError(f"Trainer(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is None:
        raise AdoptionError("Trainer(model, optimizer): pass the torch.optim optimizer your script builds, e.g. "
                            "torch.optim.AdamW(model.parameters(), lr=1e-3); unbroken does not choose one for you")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AdoptionError(f"Trainer(model, optimizer): optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_of[id(p)] = gi
    mine = {id(p) for p in model.parameters()}
    foreign = [gi for pid, gi in group_of.items() if pid not in mine]
    if foreign:
        raise AdoptionError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
                            f"(param group {foreign[0]}): build the optimizer from model.parameters() (or groups "
                            "of them) of the model passed to Trainer")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in group_of]
    if not named:
        raise AdoptionError("no parameter of the model both requires grad and is held by the optimizer: "
                            "nothing would be trained")
    return named, [group_of[id(p)] for _, p in named]


def check_device(named: list[tuple[str, nn.Parameter]], expected: torch.device) -> None:
    """Every trained parameter must already be on this rank's device: unbroken never moves a
    user's tensors across devices behind its back (it keeps them as views of its flat buffer)."""
    for name, p in named:
        if p.device != expected:
            raise AdoptionError(
                f"parameter {name} is on {p.device}, but this rank trains on {expected} (gloo: the CPU; nccl: the "
                f"GPU of LOCAL_RANK, see unbroken.device()): build the model there, e.g. model.to('{expected}')")


def check_options(grad_clip, accumulation_steps) -> None:
    if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                  or not grad_clip > 0):
        raise AdoptionError(f"grad_clip must be a number > 0 (the max global gradient norm) or None, got {grad_clip!r}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise AdoptionError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")


def clip_coefficient(grad_clip: float | None, norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if grad_clip is None:
        return 1.0
    return min(1.0, grad_clip / (norm + 1e-6))


def aliases_of(model: torch.nn.Module) -> dict[str, str]:
    """Tied weights: each name of a parameter or buffer that an earlier name already holds -> that
    first name (the one `named_parameters()`/`named_buffers()` keep), e.g. nanoGPT's
    {"lm_head.weight": "transformer.wte.weight"}. What layout.pt's `aliases` records."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        canon = first.setdefault(id(t), name)
        if canon != name:
            out[name] = canon
    return out
