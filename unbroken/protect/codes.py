"""Erasure codes over the raw bytes of tensors: XOR parity and systematic Reed–Solomon k+m.

Everything works in place on caller-owned buffers so the hot path allocates nothing.
`_codes_reference.py` holds the naive versions the tests compare against.
"""
from __future__ import annotations

import functools
import time
from typing import Mapping, Sequence

import numpy as np
import torch

# ---------------------------------------------------------------------------------------
# Byte views
# ---------------------------------------------------------------------------------------

# Widest first: torch XOR on int64 runs ~8x fewer elements than on uint8.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `t`'s memory (any dtype); writes through the view change `t`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(t.shape)} is not contiguous; parity covers a tensor's memory "
            "in place, so pass a contiguous tensor (e.g. t.contiguous(), kept by the caller)")
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _word_size(*byte_views: torch.Tensor) -> int:
    """Widest word all views can be reinterpreted as (their start offsets must align)."""
    for size, _ in _WORDS:
        if all(b.storage_offset() % size == 0 for b in byte_views):
            return size
    return 1


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The widest integer view (int64, int32, int16 or uint8) that `t`'s byte length and offset allow."""
    b = as_bytes(t)
    for size, dtype in _WORDS:
        if b.numel() % size == 0 and b.storage_offset() % size == 0:
            return b if size == 1 else b.view(dtype)
    return b


def _split(n: int, size: int, *byte_views: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each view's first n bytes as (wide body, uint8 tail) pairs, body length a multiple of size."""
    body = n - n % size
    dtype = dict(_WORDS)[size]
    heads = [b[:body] if size == 1 else b[:body].view(dtype) for b in byte_views]
    tails = [b[body:n] for b in byte_views]
    return heads, tails


def _xor2(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n: int) -> None:
    """out[:n] = a[:n] ^ b[:n] on uint8 views, computed on the widest common words."""
    heads, tails = _split(n, _word_size(out, a, b), out, a, b)
    torch.bitwise_xor(heads[1], heads[2], out=heads[0])
    if tails[0].numel():
        torch.bitwise_xor(tails[1], tails[2], out=tails[0])


def _check_device(dst: torch.Tensor, *others: torch.Tensor) -> None:
    for o in others:
        if o.device != dst.device:
            raise ValueError(f"all buffers must be on one device: {dst.device} vs {o.device}")


def xor_into(dst: torch.Tensor, *srcs: torch.Tensor) -> None:
    """dst ^= each src, byte for byte. A src shorter than dst acts as zero-padded."""
    d = as_bytes(dst)
    for src in srcs:
        s = as_bytes(src)
        _check_device(dst, src)
        if s.numel() > d.numel():
            raise ValueError(
                f"source has {s.numel()} bytes but destination only {d.numel()}; "
                "the destination must be at least as long as every source")
        _xor2(d, d, s, s.numel())


def xor_parity(out: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """out = XOR of `pieces` (each zero-padded to out's byte length), written in place."""
    if not pieces:
        raise ValueError("xor_parity needs at least one piece")
    o = as_bytes(out)
    bs = [as_bytes(p) for p in pieces]
    _check_device(out, *pieces)
    if any(b.numel() > o.numel() for b in bs):
        raise ValueError(
            f"pieces have {[b.numel() for b in bs]} bytes but the parity buffer only {o.numel()}; "
            "allocate the parity buffer as long as the longest piece")
    if len(bs) >= 2 and bs[0].numel() == bs[1].numel() == o.numel():
        _xor2(o, bs[0], bs[1], o.numel())  # fuses the first copy into the first XOR
        rest = bs[2:]
    else:
        o[: bs[0].numel()].copy_(bs[0])
        o[bs[0].numel():].zero_()
        rest = bs[1:]
    for b in rest:
        _xor2(o, o, b, b.numel())


def xor_recover(out: torch.Tensor, parity: torch.Tensor, surviving_pieces: Sequence[torch.Tensor]) -> None:
    """out = the lost piece: parity XOR every surviving piece, truncated to out's byte length."""
    o, p = as_bytes(out), as_bytes(parity)
    _check_device(out, parity, *surviving_pieces)
    n = o.numel()
    if n > p.numel():
        raise ValueError(
            f"the lost piece buffer has {n} bytes but the parity only {p.numel()}; "
            "a piece can be at most as long as its parity")
    bs = [as_bytes(s) for s in surviving_pieces]
    if bs and bs[0].numel() >= n:
        _xor2(o, p, bs[0], n)
        bs = bs[1:]
    else:
        o.copy_(p[:n])
    for b in bs:
        _xor2(o, o, b, min(n, b.numel()))


# ---------------------------------------------------------------------------------------
# GF(2^8) arithmetic
# ---------------------------------------------------------------------------------------

_POLY = 0x11D


def _gf_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.int64)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= _POLY
    exp[255:510] = exp[:255]
    a = np.arange(256)
    mul = exp[log[a][:, None] + log[a][None, :]].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return exp, log, mul


_EXP, _LOG, MUL = _gf_tables()  # MUL[a, b] = a * b in GF(2^8)


def gf_inv(a: int) -> int:
    assert 0 < a < 256, f"only nonzero field elements have inverses, got {a}"
    return int(_EXP[255 - _LOG[a]])


def _gf_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(r x n) @ (n x c) over GF(2^8), vectorized over the outer dimensions."""
    prod = MUL[a[:, :, None], b[None, :, :]]  # r x n x c
    return np.bitwise_xor.reduce(prod, axis=1).astype(np.uint8)


def _gf_invert(matrix: np.ndarray) -> np.ndarray:
    """Gauss–Jordan inversion over GF(2^8); every row operation is one numpy call."""
    n = matrix.shape[0]
    aug = np.concatenate([matrix.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        nonzero = np.nonzero(aug[col:, col])[0]
        assert nonzero.size, "a square submatrix of a Cauchy-systematic generator is never singular"
        pivot = col + int(nonzero[0])
        aug[[col, pivot]] = aug[[pivot, col]]
        aug[col] = MUL[gf_inv(int(aug[col, col]))][aug[col]]
        factors = aug[:, col].copy()
        factors[col] = 0
        aug ^= MUL[factors[:, None], aug[col][None, :]]
    return aug[:, n:]


def _generator(k: int, m: int) -> np.ndarray:
    """(k+m) x k: identity over a Cauchy block 1/(x_i + y_j), x_i = k+i, y_j = j.

    Every square submatrix of a Cauchy matrix is invertible, so any k rows of
    [I; C] are too: any k of the k+m shards decode.
    """
    x = np.arange(k, k + m)[:, None]
    y = np.arange(k)[None, :]
    cauchy = _EXP[255 - _LOG[x ^ y]].astype(np.uint8)
    return np.concatenate([np.eye(k, dtype=np.uint8), cauchy], axis=0)


@functools.lru_cache(maxsize=64)
def _table16(c: int) -> np.ndarray:
    """c * (both bytes of every uint16), as a 65536-entry uint16 table (128 KiB, cache-resident)."""
    pairs = np.arange(65536, dtype=np.uint16).view(np.uint8)
    return MUL[c][pairs].view(np.uint16)


# 32768 uint16 = 64 KiB per chunk: the index buffer and a table stay in L2.
_CHUNK = 1 << 15


def _combine_chunk(out16: np.ndarray, s: np.ndarray, ix: np.ndarray, tmp: np.ndarray,
                   c: int, first: bool) -> None:
    """out16 (^)= c * s on one chunk of uint16 pairs; `first` assigns instead of accumulating."""
    if c == 0:
        if first:
            out16[:] = 0
    elif c == 1:
        if first:
            out16[:] = s
        else:
            np.bitwise_xor(out16, s, out=out16)
    elif first:
        np.take(_table16(c), ix, out=out16, mode="clip")
    else:
        np.take(_table16(c), ix, out=tmp, mode="clip")
        np.bitwise_xor(out16, tmp, out=out16)


def _combine(coeffs: np.ndarray, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
    """outputs[i] = XOR_j coeffs[i, j] * inputs[j], all flat uint8 arrays of one length."""
    n = inputs[0].size
    half = n // 2
    idx = np.empty(min(_CHUNK, max(half, 1)), dtype=np.intp)
    tmp = np.empty(idx.size, dtype=np.uint16)
    outs16 = [o[: 2 * half].view(np.uint16) for o in outputs]
    for j, src in enumerate(inputs):
        src16 = src[: 2 * half].view(np.uint16)
        for start in range(0, half, _CHUNK):
            stop = min(start + _CHUNK, half)
            ix = idx[: stop - start]
            ix[:] = src16[start:stop]  # one widening per input chunk, shared by all outputs
            for i, out16 in enumerate(outs16):
                _combine_chunk(out16[start:stop], src16[start:stop], ix, tmp[: stop - start],
                               int(coeffs[i, j]), first=j == 0)
    if n % 2:
        last = np.array([int(src[-1]) for src in inputs])
        for i, o in enumerate(outputs):
            o[-1] = np.bitwise_xor.reduce(MUL[coeffs[i], last])


# ---------------------------------------------------------------------------------------
# Reed–Solomon
# ---------------------------------------------------------------------------------------


def _host_bytes(t: torch.Tensor, what: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; Reed–Solomon runs on CPU, pass t.cpu() buffers")
    return as_bytes(t).numpy()


class ReedSolomon:
    """Systematic Reed–Solomon over GF(2^8): k data shards, m parity shards, any k decode."""

    def __init__(self, k: int, m: int) -> None:
        if not (isinstance(k, int) and isinstance(m, int) and k >= 1 and m >= 1 and k + m <= 255):
            raise ValueError(
                f"Reed–Solomon needs integers k >= 1, m >= 1 and k + m <= 255, got k={k!r}, m={m!r}; "
                "for a single loss per group use XOR parity (xor_parity) instead")
        self.k, self.m = k, m
        self.generator = _generator(k, m)

    def _arrays(self, shards: Sequence[torch.Tensor], what: str) -> list[np.ndarray]:
        arrays = [_host_bytes(s, f"{what} {i}") for i, s in enumerate(shards)]
        sizes = {a.size for a in arrays}
        if len(sizes) > 1:
            raise ValueError(
                f"all shards must have the same byte length, got {[a.size for a in arrays]}; "
                "zero-pad the shorter ones to the longest")
        return arrays

    def encode(self, data_shards: Sequence[torch.Tensor], out_parity: Sequence[torch.Tensor]) -> None:
        """Write the m parity shards of k equal-length data shards into `out_parity` in place."""
        if len(data_shards) != self.k or len(out_parity) != self.m:
            raise ValueError(
                f"ReedSolomon(k={self.k}, m={self.m}) encodes {self.k} data shards into {self.m} "
                f"parity buffers, got {len(data_shards)} and {len(out_parity)}")
        arrays = self._arrays([*data_shards, *out_parity], "shard")
        _combine(self.generator[self.k:], arrays[: self.k], arrays[self.k:])

    def decode(self, shards: Sequence[torch.Tensor | None], *,
               out: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Rebuild the missing (None) shards; returns all k+m shards in order.

        A missing shard i is written into `out[i]` when given, else into a new uint8 tensor.
        Survivors are returned as passed (not copied).
        """
        if len(shards) != self.k + self.m:
            raise ValueError(f"decode takes all k+m={self.k + self.m} shard slots (None for lost), "
                             f"got {len(shards)}")
        have = [i for i, s in enumerate(shards) if s is not None]
        lost = [i for i, s in enumerate(shards) if s is None]
        if len(lost) > self.m:
            raise ValueError(
                f"{len(lost)} shards lost ({lost}) but ReedSolomon(k={self.k}, m={self.m}) decodes at "
                f"most {self.m}; fall back to a persistent checkpoint (tier 2)")
        survivors = self._arrays([shards[i] for i in have], "shard")
        nbytes = survivors[0].size
        out = dict(out or {})
        result: list[torch.Tensor] = []
        for i, s in enumerate(shards):
            if s is None:
                s = out.get(i)
                if s is None:
                    s = torch.empty(nbytes, dtype=torch.uint8)
                elif as_bytes(s).numel() != nbytes:
                    raise ValueError(f"out[{i}] has {as_bytes(s).numel()} bytes, shards have {nbytes}")
            result.append(s)
        if lost:
            use = have[: self.k]  # data shards first: the cheapest survivors to combine
            inv = _gf_invert(self.generator[use])
            coeffs = _gf_matmul(self.generator[lost], inv)
            _combine(coeffs, survivors[: self.k], self._arrays([result[i] for i in lost], "out"))
        return result


# ---------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, lazy allocation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_encode_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """XOR parity of 3 pieces of `nbytes` each into a preallocated buffer, vs `dst.copy_(src)` of nbytes.

    encode_gbps counts the bytes of input read (3 * nbytes per encode); memcpy_gbps counts
    nbytes per copy. Both are best-of-`repeats` after one warm-up, in 1e9 bytes per second.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"need nbytes >= 1 and repeats >= 1, got nbytes={nbytes}, repeats={repeats}")
    pieces = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(3)]
    out = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    t_encode = _best_seconds(lambda: xor_parity(out, pieces), repeats)
    t_copy = _best_seconds(lambda: dst.copy_(pieces[0]), repeats)
    encode_gbps = 3 * nbytes / t_encode / 1e9
    memcpy_gbps = nbytes / t_copy / 1e9
    return {"encode_gbps": encode_gbps, "memcpy_gbps": memcpy_gbps,
            "encode_vs_memcpy": encode_gbps / memcpy_gbps, "nbytes": nbytes, "pieces": 3,
            "repeats": repeats}


def measure_rs_bandwidth(nbytes: int, repeats: int, *, k: int = 4, m: int = 2) -> dict[str, float]:
    """Reed–Solomon k+m encode of k data shards of `nbytes` each into m preallocated parity shards.

    encode_gbps counts the bytes of data read (k * nbytes per encode), best of `repeats`.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"need nbytes >= 1 and repeats >= 1, got nbytes={nbytes}, repeats={repeats}")
    rs = ReedSolomon(k, m)
    data = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(k)]
    parity = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(m)]
    seconds = _best_seconds(lambda: rs.encode(data, parity), repeats)
    return {"encode_gbps": k * nbytes / seconds / 1e9, "k": k, "m": m, "nbytes": nbytes,
            "repeats": repeats}
