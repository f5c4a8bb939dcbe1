"""Erasure codes: the fast XOR / Reed–Solomon paths against the naive reference, every erasure pattern."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.protect import _codes_reference as ref
from unbroken.protect.codes import (MUL, ReedSolomon, as_bytes, as_words, gf_inv,
                                    measure_encode_bandwidth, measure_rs_bandwidth, xor_into,
                                    xor_parity, xor_recover)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.float64, torch.int16]
FAST = settings(max_examples=60, deadline=None)


def _tensor(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding `raw`, cut (or zero-padded) to whole elements, at least one."""
    size = torch.empty((), dtype=dtype).element_size()
    usable = max(len(raw) - len(raw) % size, size)
    return torch.frombuffer(bytearray(raw[:usable].ljust(usable, b"\0")), dtype=dtype).clone()


def _raw(t: torch.Tensor) -> bytes:
    return bytes(as_bytes(t).tolist())


# --------------------------------------------------------------------------- views


@pytest.mark.parametrize("dtype", DTYPES)
def test_as_bytes_is_a_writable_view(dtype):
    t = torch.zeros(5, 3, dtype=dtype)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.numel() == t.numel() * t.element_size()
    b.fill_(0xFF)
    assert _raw(t) == b"\xff" * b.numel()


def test_as_bytes_rejects_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(torch.zeros(4, 4).t())


@pytest.mark.parametrize("nbytes,offset,word", [(16, 0, torch.int64), (12, 0, torch.int32),
                                                 (6, 0, torch.int16), (7, 0, torch.uint8),
                                                 (16, 4, torch.int32), (16, 1, torch.uint8)])
def test_as_words_picks_the_widest_view_allowed(nbytes, offset, word):
    buf = torch.zeros(64, dtype=torch.uint8)[offset: offset + nbytes]
    w = as_words(buf)
    assert w.dtype == word and w.numel() * w.element_size() == nbytes
    assert w.data_ptr() == buf.data_ptr()


# --------------------------------------------------------------------------- XOR


@FAST
@given(st.lists(st.binary(min_size=0, max_size=70), min_size=1, max_size=5),
       st.integers(0, 9), st.integers(0, 9))
def test_xor_parity_matches_reference(pieces, extra, offset):
    length = max(len(p) for p in pieces) + extra
    backing = torch.zeros(length + offset, dtype=torch.uint8)
    out = backing[offset:]  # odd offsets exercise the narrow-word paths
    out.fill_(0xAB)  # parity must not depend on what the buffer held
    xor_parity(out, [torch.tensor(list(p), dtype=torch.uint8) for p in pieces])
    assert _raw(out) == ref.xor_ref(pieces, length)


@FAST
@given(st.binary(min_size=0, max_size=70), st.lists(st.binary(max_size=70), max_size=4))
def test_xor_into_matches_reference(dst, srcs):
    length = max([len(dst)] + [len(s) for s in srcs])
    dst = dst + bytes(length - len(dst))
    t = torch.tensor(list(dst), dtype=torch.uint8)
    xor_into(t, *[torch.tensor(list(s), dtype=torch.uint8) for s in srcs])
    assert _raw(t) == ref.xor_ref([dst, *srcs], length)


@FAST
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=90), st.sampled_from(DTYPES)),
                min_size=2, max_size=5), st.data())
def test_xor_recovers_any_lost_piece_of_any_dtype(spec, data):
    pieces = [_tensor(raw, dtype) for raw, dtype in spec]
    parity = torch.empty(max(as_bytes(p).numel() for p in pieces), dtype=torch.uint8)
    xor_parity(parity, pieces)
    lost = data.draw(st.integers(0, len(pieces) - 1))
    out = torch.full_like(pieces[lost], 3)
    xor_recover(out, parity, [p for i, p in enumerate(pieces) if i != lost])
    assert _raw(out) == _raw(pieces[lost])  # bitwise, NaN payloads included


def test_xor_on_wide_tensors_crosses_word_boundaries():
    pieces = [torch.randn(1001), torch.randn(1001), torch.randn(1001)]
    parity = torch.empty(1001)
    xor_parity(parity, pieces)
    out = torch.empty(1001)
    xor_recover(out, parity, pieces[1:])
    assert torch.equal(as_bytes(out), as_bytes(pieces[0]))


def test_xor_length_errors_say_what_to_allocate():
    with pytest.raises(ValueError, match="at least as long"):
        xor_into(torch.zeros(3, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="longest piece"):
        xor_parity(torch.zeros(3, dtype=torch.uint8), [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="at least one"):
        xor_parity(torch.zeros(3, dtype=torch.uint8), [])
    with pytest.raises(ValueError, match="at most as long"):
        xor_recover(torch.zeros(5, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), [])


# --------------------------------------------------------------------------- GF(2^8)


def test_multiplication_table_matches_reference_field():
    expected = np.array([[ref.gf_mul_ref(a, b) for b in range(256)] for a in range(256)],
                        dtype=np.uint8)
    assert np.array_equal(MUL, expected)
    assert all(gf_inv(a) == ref.gf_inv_ref(a) for a in range(1, 256))


@pytest.mark.parametrize("k,m", [(1, 1), (3, 2), (4, 2), (5, 3), (10, 4), (2, 7)])
def test_generator_matches_reference(k, m):
    assert ReedSolomon(k, m).generator.tolist() == ref.generator_ref(k, m)


# --------------------------------------------------------------------------- Reed–Solomon


@st.composite
def _code_and_data(draw, shapes=((3, 2), (4, 2), (5, 3), (1, 2), (6, 1))):
    k, m = draw(st.sampled_from(shapes))
    n = draw(st.integers(1, 48))
    return k, m, [draw(st.binary(min_size=n, max_size=n)) for _ in range(k)]


def _u8(raw: bytes) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.uint8)


@FAST
@given(_code_and_data())
def test_rs_encode_matches_reference(case):
    k, m, data = case
    parity = [torch.full((len(data[0]),), 0x5A, dtype=torch.uint8) for _ in range(m)]
    ReedSolomon(k, m).encode([_u8(d) for d in data], parity)
    assert [_raw(p) for p in parity] == ref.rs_encode_ref(k, m, data)


@settings(max_examples=15, deadline=None)
@given(_code_and_data(shapes=((3, 2), (4, 2), (5, 3))))
def test_rs_every_erasure_pattern_up_to_m_decodes_bitwise(case):
    k, m, data = case
    rs = ReedSolomon(k, m)
    shards = [_u8(d) for d in data] + [torch.empty(len(data[0]), dtype=torch.uint8) for _ in range(m)]
    rs.encode(shards[:k], shards[k:])
    expected = [_raw(s) for s in shards]
    for losses in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), losses):
            got = rs.decode([None if i in lost else s for i, s in enumerate(shards)])
            assert [_raw(s) for s in got] == expected, f"pattern {lost}"


def test_rs_reference_decoder_agrees_on_a_pattern():
    data = [b"abcde", b"fghij", b"klmno", b"pqrst"]
    shards = data + ref.rs_encode_ref(4, 2, data)
    got = ReedSolomon(4, 2).decode([None, _u8(shards[1]), None] + [_u8(s) for s in shards[3:]])
    assert [_raw(s) for s in got] == ref.rs_decode_ref(4, 2, [None, shards[1], None, *shards[3:]])


@pytest.mark.parametrize("k,m", [(3, 2), (4, 2), (5, 3)])
def test_rs_more_than_m_losses_raise(k, m):
    rs = ReedSolomon(k, m)
    shards = [torch.zeros(8, dtype=torch.uint8) for _ in range(k + m)]
    for lost in itertools.combinations(range(k + m), m + 1):
        with pytest.raises(ValueError, match="decodes at most"):
            rs.decode([None if i in lost else s for i, s in enumerate(shards)])


def test_rs_decodes_into_provided_buffers_and_large_shards_cross_chunks():
    rs = ReedSolomon(4, 2)
    n = 200_003  # several 64 KiB chunks plus an odd tail byte
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _ in range(4)]
    parity = [torch.empty(n, dtype=torch.uint8) for _ in range(2)]
    rs.encode(data, parity)
    gen = ref.generator_ref(4, 2)
    for pos in (0, 65535, 65536, 65537, 131072, n - 2, n - 1):
        for i in range(2):
            want = 0
            for j in range(4):
                want ^= ref.gf_mul_ref(gen[4 + i][j], int(data[j][pos]))
            assert int(parity[i][pos]) == want, (pos, i)
    bufs = {0: torch.empty(n, dtype=torch.uint8), 3: torch.empty(n, dtype=torch.uint8)}
    got = rs.decode([None, data[1], data[2], None, *parity], out=bufs)
    assert got[0] is bufs[0] and got[3] is bufs[3]
    assert torch.equal(bufs[0], data[0]) and torch.equal(bufs[3], data[3])


def test_rs_works_on_byte_views_of_any_dtype():
    rs = ReedSolomon(3, 2)
    data = [torch.randn(10), torch.randn(10), torch.randn(10)]
    parity = [torch.empty(10), torch.empty(10)]
    rs.encode(data, parity)
    got = rs.decode([data[0], None, None, parity[0], parity[1]],
                    out={1: torch.empty(10), 2: torch.empty(10)})
    assert torch.equal(as_bytes(got[1]), as_bytes(data[1]))
    assert torch.equal(as_bytes(got[2]), as_bytes(data[2]))


@pytest.mark.parametrize("k,m", [(0, 2), (2, 0), (250, 6), (2.0, 2), (-1, 3)])
def test_rs_bad_shape_raises(k, m):
    with pytest.raises(ValueError, match="k \\+ m <= 255"):
        ReedSolomon(k, m)


def test_rs_input_errors():
    rs = ReedSolomon(2, 2)
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same byte length"):
        rs.encode([a, b], [torch.zeros(4, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError, match="encodes 2 data shards"):
        rs.encode([a], [a, a])
    with pytest.raises(ValueError, match="k\\+m=4"):
        rs.decode([a, a, a])
    with pytest.raises(ValueError, match="out\\[0\\]"):
        rs.decode([None, a, a, a], out={0: b})


# --------------------------------------------------------------------------- bandwidth


def test_bandwidth_measurements_report_ratios():
    xor = measure_encode_bandwidth(1 << 20, 2)
    rs = measure_rs_bandwidth(1 << 18, 1)
    print(f"\nXOR encode {xor['encode_gbps']:.2f} GB/s vs memcpy {xor['memcpy_gbps']:.2f} GB/s "
          f"({xor['encode_vs_memcpy']:.2f}x); RS 4+2 encode {rs['encode_gbps']:.2f} GB/s")
    assert xor["encode_gbps"] > 0 and xor["memcpy_gbps"] > 0 and rs["encode_gbps"] > 0
    assert xor["encode_vs_memcpy"] == pytest.approx(xor["encode_gbps"] / xor["memcpy_gbps"])
    with pytest.raises(ValueError, match="nbytes >= 1"):
        measure_encode_bandwidth(0, 1)
