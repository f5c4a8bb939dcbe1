"""Squeezed messages (comm/squeeze.py): the same bits back, fewer bytes where there is redundancy,
and a damaged or mismatched message refused before anything is written."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.bench import squeeze_codec
from unbroken.comm import squeeze

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def _received(msg: torch.Tensor, nbytes: int) -> torch.Tensor:
    """What a receive buffer of `bound(nbytes)` holds after the message arrived (gloo fills a prefix)."""
    buf = torch.full((squeeze.bound(nbytes),), 0xAB, dtype=torch.uint8)
    buf[:msg.numel()] = msg
    return buf


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_a_squeezed_tensor_comes_back_bit_for_bit_and_never_outgrows_the_bound(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    msg = squeeze.squeeze(x)
    nbytes = x.numel() * x.element_size()
    assert msg.numel() <= squeeze.bound(nbytes) and squeeze.wire_bytes(_received(msg, nbytes)) == msg.numel()
    out = torch.empty_like(x)
    squeeze.unsqueeze(_received(msg, nbytes), out)
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))


def test_normal_values_take_fewer_bytes_and_the_codec_section_says_how_many():
    res = squeeze_codec.measure(nbytes=1 << 18, reps=1)
    kinds = res["kinds"]
    assert kinds["float32"]["ratio"] > 1.1 and kinds["bfloat16"]["ratio"] > kinds["float32"]["ratio"]
    assert 0.98 < kinds["random_bytes"]["ratio"] <= 1.0  # nothing to gain: stored, a few bytes of framing
    assert all(k["compress_MBps"] > 0 and k["decode_MBps"] > 0 for k in kinds.values())


def test_a_damaged_or_mismatched_message_is_refused_before_writing():
    x = torch.randn(4096)
    msg = squeeze.squeeze(x)
    out = torch.zeros_like(x)
    bad = _received(msg, x.numel() * 4)
    bad[msg.numel() // 2] ^= 0xFF  # one byte flipped in the frame: zstd's checksum (or its format) refuses it
    with pytest.raises(squeeze.SqueezeError):
        squeeze.unsqueeze(bad, out)
    assert torch.count_nonzero(out) == 0
    with pytest.raises(squeeze.SqueezeError, match="decodes to|does not decode"):
        squeeze.unsqueeze(_received(msg, x.numel() * 4), torch.zeros(4095))  # not the sender's size
    liar = _received(msg, x.numel() * 4)
    liar[:8] = torch.frombuffer(bytearray((1 << 40).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(squeeze.SqueezeError, match="claims"):
        squeeze.unsqueeze(liar, out)


def test_a_message_whose_plane_lengths_lie_is_refused_before_writing():
    x = torch.randn(4096)
    msg = squeeze.squeeze(x)
    liar = _received(msg, x.numel() * 4)
    first = int.from_bytes(liar[8:12].numpy().tobytes(), "little")
    liar[8:12] = torch.frombuffer(bytearray((first + 1).to_bytes(4, "little")), dtype=torch.uint8)
    out = torch.zeros_like(x)
    with pytest.raises(squeeze.SqueezeError, match="planes take"):
        squeeze.unsqueeze(liar, out)
    assert torch.count_nonzero(out) == 0


def test_only_the_planes_with_redundancy_shrink():
    """Normal float32 values: the sign-and-exponent plane shrinks, the low mantissa planes are stored
    (each frame a few bytes over its plane)."""
    x = torch.randn(1 << 16)
    msg = squeeze.squeeze(x).numpy()
    lengths = [int.from_bytes(msg[8 + 4 * p:12 + 4 * p].tobytes(), "little") for p in range(4)]
    assert all(x.numel() <= n <= x.numel() + 64 for n in lengths[:2])
    assert lengths[3] < x.numel() / 2
