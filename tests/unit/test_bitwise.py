"""The local half of the exchange path: integer views of any tensor and the XOR/AND fold."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.comm.bitwise import fold, int_view

DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float64, torch.bool]


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), offset=st.integers(0, 7))
def test_int_view_is_the_same_bytes_without_a_copy(dtype, n, offset):
    base = torch.zeros(n + offset, dtype=dtype)
    t = base[offset:]
    v = int_view(t)
    assert v.dtype in (torch.uint8, torch.int32, torch.int64)
    assert v.numel() * v.element_size() == t.numel() * t.element_size()
    assert v.data_ptr() == t.data_ptr()  # a view: writing the result back writes the caller's tensor
    if n:
        v.fill_(-1 if v.dtype != torch.uint8 else 255)
        assert bytes(t.view(torch.uint8).numpy()) == b"\xff" * (n * t.element_size())


def test_int_view_refuses_a_strided_tensor_naming_the_fix():
    with pytest.raises(ValueError, match=r"contiguous.*t.contiguous\(\)"):
        int_view(torch.zeros(4, 4, dtype=torch.int32)[:, 1])


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 64), op=st.sampled_from(["xor", "and"]), seed=st.integers(0, 999))
def test_fold_equals_numpy_bitwise_reduce(rows, cols, op, seed):
    x = np.random.default_rng(seed).integers(-(1 << 62), 1 << 62, size=(rows, cols), dtype=np.int64)
    want = functools.reduce(np.bitwise_xor if op == "xor" else np.bitwise_and, list(x))
    src = torch.from_numpy(x.copy())
    got = fold(src, op)
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(src.numpy(), x)  # the input rows are not changed


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="one of xor, and"):
        fold(torch.zeros(2, 2, dtype=torch.int32), "or")


def test_comm_refuses_an_unknown_backend_or_bitwise_mode_before_connecting():
    import torch.distributed as dist

    from unbroken.comm.group import Comm

    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        Comm(dist.HashStore(), rank=0, world=1, gen=0, timeout_s=5, backend="mpi")
    with pytest.raises(ValueError, match="bitwise_reduce must be one of auto, exchange, got 'native'"):
        Comm(dist.HashStore(), rank=0, world=1, gen=0, timeout_s=5, bitwise_reduce="native")


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="checks a torch build without NCCL")
def test_an_nccl_group_without_nccl_fails_its_rendezvous_naming_the_fix():
    import torch.distributed as dist

    from unbroken.comm.group import CollectiveError, Comm

    with pytest.raises(CollectiveError, match="this torch build has no NCCL; use --backend gloo"):
        Comm(dist.HashStore(), rank=0, world=1, gen=0, timeout_s=5, backend="nccl")


def test_a_one_rank_group_routes_cpu_tensors_to_gloo_and_honours_the_switch():
    import torch.distributed as dist

    from unbroken.comm.group import Comm

    native = Comm(dist.HashStore(), rank=0, world=1, gen=0, timeout_s=5)
    forced = Comm(dist.HashStore(), rank=0, world=1, gen=0, timeout_s=5, bitwise_reduce="exchange")
    t = torch.arange(5, dtype=torch.int32)
    assert native.bitwise_path(t) == "native" and forced.bitwise_path(t) == "exchange"
    for comm in (native, forced):
        x = t.clone()
        comm.xor_reduce(x, 0, what="one-rank xor")
        comm.and_allreduce(x, what="one-rank and")
        assert x.equal(t)  # the XOR / AND of one rank's tensor is itself
        comm.retire()
