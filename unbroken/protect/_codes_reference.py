"""Naive reference erasure codes (pure Python, byte by byte) that `codes.py` is tested against.

Slow on purpose: every GF(2^8) product is a shift-and-add loop, every matrix is a
list of lists. Only tests use this module.
"""
from __future__ import annotations

POLY = 0x11D  # x^8 + x^4 + x^3 + x^2 + 1, the usual Reed–Solomon field polynomial


def xor_ref(pieces: list[bytes], length: int) -> bytes:
    """XOR of `pieces`, each zero-padded to `length` bytes."""
    out = [0] * length
    for piece in pieces:
        for i, byte in enumerate(piece):
            out[i] ^= byte
    return bytes(out)


def gf_mul_ref(a: int, b: int) -> int:
    """Carry-less multiply of two field elements, reduced modulo POLY."""
    result = 0
    while b:
        if b & 1:
            result ^= a
        a <<= 1
        if a & 0x100:
            a ^= POLY
        b >>= 1
    return result


def gf_inv_ref(a: int) -> int:
    """Multiplicative inverse by exhaustive search (the field has 255 units)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    for b in range(1, 256):
        if gf_mul_ref(a, b) == 1:
            return b
    raise AssertionError(f"no inverse found for {a}")


def generator_ref(k: int, m: int) -> list[list[int]]:
    """The (k+m) x k systematic generator: identity on top, Cauchy rows 1/(x_i + y_j) below."""
    rows = [[1 if i == j else 0 for j in range(k)] for i in range(k)]
    for i in range(m):
        rows.append([gf_inv_ref((k + i) ^ j) for j in range(k)])
    return rows


def _invert_ref(matrix: list[list[int]]) -> list[list[int]]:
    """Gauss–Jordan inversion over GF(2^8)."""
    n = len(matrix)
    aug = [list(row) + [1 if i == j else 0 for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if aug[r][col] != 0)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        inv = gf_inv_ref(aug[col][col])
        aug[col] = [gf_mul_ref(inv, v) for v in aug[col]]
        for r in range(n):
            factor = aug[r][col]
            if r != col and factor:
                aug[r] = [v ^ gf_mul_ref(factor, p) for v, p in zip(aug[r], aug[col])]
    return [row[n:] for row in aug]


def _combine_ref(coeffs: list[int], shards: list[bytes]) -> bytes:
    out = [0] * len(shards[0])
    for c, shard in zip(coeffs, shards):
        for i, byte in enumerate(shard):
            out[i] ^= gf_mul_ref(c, byte)
    return bytes(out)


def rs_encode_ref(k: int, m: int, data: list[bytes]) -> list[bytes]:
    """The m parity shards of k equal-length data shards."""
    gen = generator_ref(k, m)
    return [_combine_ref(gen[k + i], data) for i in range(m)]


def rs_decode_ref(k: int, m: int, shards: list[bytes | None]) -> list[bytes]:
    """All k+m shards, given any k of them (missing ones are None)."""
    gen = generator_ref(k, m)
    have = [i for i, s in enumerate(shards) if s is not None][:k]
    if len(have) < k:
        raise ValueError(f"need {k} shards, have {len(have)}")
    inv = _invert_ref([gen[i] for i in have])
    data = [_combine_ref(inv[j], [shards[i] for i in have]) for j in range(k)]
    return [s if s is not None else _combine_ref(gen[i], data) for i, s in enumerate(shards)]
