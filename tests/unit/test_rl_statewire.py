"""statewire: weights and optimizer state packed into one flat tensor and a JSON layout come back
bitwise, with integer keys and tuples as they were, and the next step is the same step."""
import json

import pytest
import torch

from unbroken.rl import statewire


def _trained(seed: int, steps: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_a_packed_state_loads_bitwise_and_steps_the_same(steps):
    src, src_opt = _trained(0, steps)
    dst, dst_opt = _trained(1, 0)  # other weights, an optimizer that never stepped
    layout, flat = statewire.pack(src, src_opt)
    assert flat.dtype == torch.uint8 and flat.numel() % 8 == 0
    statewire.unpack_into(dst, dst_opt, layout, flat.clone())
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k
    a, b = src_opt.state_dict(), dst_opt.state_dict()
    assert a["param_groups"] == b["param_groups"] and isinstance(b["param_groups"][0]["betas"], tuple)
    assert sorted(a["state"]) == sorted(b["state"]) and all(isinstance(k, int) for k in b["state"])
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    x = torch.randn(4, 5)
    for m, o in ((src, src_opt), (dst, dst_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(src.parameters(), dst.parameters()))


def test_a_layout_naming_a_non_dtype_is_refused():
    model, opt = _trained(0, 1)
    layout, flat = statewire.pack(model, opt)
    bad = json.dumps(json.loads(layout)).replace('"float32"', '"nn"', 1).encode()
    with pytest.raises(ValueError, match="unknown dtype 'nn'"):
        statewire.unpack_into(model, opt, bad, flat)
