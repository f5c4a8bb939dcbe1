"""The flat buffers live on the model's device; nothing moves a user's parameters (issue 15)."""
import pytest
import torch
import torch.nn as nn

from unbroken.parallel.flat import FlatModel
from unbroken.runtime.adopt import AdoptionError, check_device


def _named(*mods):
    return [(f"m{i}.{n}", p) for i, m in enumerate(mods) for n, p in m.named_parameters()]


def test_the_buffers_are_allocated_where_the_parameters_are():
    flat = FlatModel(_named(nn.Linear(3, 2)), world=2, chunk_elems=16, multiple=1, grad_slots=2)
    assert flat.device == torch.device("cpu")
    assert flat.params.device == flat.grads.device == flat.grads_of(1).device == flat.device


def test_parameters_on_several_devices_are_refused():
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        FlatModel(_named(nn.Linear(3, 2), nn.Linear(2, 2, device="meta")), world=1, chunk_elems=16, multiple=1)


def test_a_model_on_another_device_is_refused_naming_the_parameter_and_the_fix():
    named = _named(nn.Linear(3, 2, device="meta"))
    with pytest.raises(AdoptionError, match=r"m0.weight is on meta, but this rank trains on cpu.*model.to\('cpu'\)"):
        check_device(named, torch.device("cpu"))
    check_device(_named(nn.Linear(3, 2)), torch.device("cpu"))  # the rank's own device: accepted


def test_protected_state_on_several_devices_is_refused():
    from unbroken.protect.chunks import ChunkedState

    with pytest.raises(ValueError, match="on one device"):
        ChunkedState([torch.zeros(4), torch.zeros(4, device="meta")], 2)
    assert ChunkedState([torch.zeros(4), torch.zeros(4)], 2).device == torch.device("cpu")
