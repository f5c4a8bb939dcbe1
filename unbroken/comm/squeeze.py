"""Lossless compression of the bytes that cross a slow link (a "squeezed" message).

A link planned around because it is slow (comm/adaptive.py) still has to carry the slow rank's own
bytes: its whole tensor out in the reduce-scatter and the whole result in during the all-gather,
which bounds any re-plan at 2(N-1)/N of the static ring's time on it (1.5x at 4 ranks). The CPU
beside such a link is mostly idle, so the direct exchange (comm/patterns.py) may send those bytes
compressed: the element bytes are shuffled into planes (every element's byte 0, then every byte 1,
...; the sign and exponent bytes of floats are few-valued) and each plane run through zstd level 1
(python-zstandard). Lossless: the receiver gets the same bits, so every pattern still equals the
reference reduction bit for bit. On normal float32 values it sends 1/1.19 of the bytes, bfloat16
1/1.48, and one core compresses and decodes a few hundred MB/s of float32 on this AMD EPYC host
(`unbroken bench collectives --only codec`, the `codec` section of bench/results/collectives.json);
a link is squeezed only below SQUEEZE_BELOW_BPS, where the codec costs a fraction of the wire time
it saves.

A message is an 8-byte little-endian length of what follows, then each plane's frame length (4
bytes each, little-endian), then one zstd frame (with its checksum) per plane. A plane per frame:
the planes that hold no redundancy (a float's low mantissa bytes) are stored at once, and 16 MB of
float32 compressed in 26 ms against 36 ms as one frame, at the same ratio (stop 54). The receiver
posts a buffer of `bound(nbytes)` (gloo fills a prefix of a larger receive buffer) and `unsqueeze`
checks the lengths, every frame's checksum and size before writing the destination.
"""
from __future__ import annotations

import numpy as np
import torch
import zstandard

SQUEEZE_BELOW_BPS = 50e6  # links slower than this (bytes/s, 400 Mbit/s) carry squeezed messages: a fraction of the codec's speed
LEVEL = 1  # zstd's fastest level that still finds the exponent planes' redundancy (1.19x vs 1.10x at -1)
HASH_LOG, MIN_MATCH = 12, 7  # a cache-sized match table, long matches only: the exponent plane of 4M float32 in ~16 ms, not ~20-30
_PARAMS = zstandard.ZstdCompressionParameters.from_level(LEVEL, hash_log=HASH_LOG, min_match=MIN_MATCH,
                                                         write_checksum=True)
_HEADER = 8  # the length of the rest of the message
_PLANE = 4  # one plane's frame length
MAX_PLANES = 16  # bytes per element of the widest dtype squeezed (complex128)


class SqueezeError(RuntimeError):
    """A squeezed message did not decode to what was expected (length, checksum or size)."""


def bound(nbytes: int) -> int:
    """The largest message `squeeze` makes of `nbytes` (zstd's worst case is stored blocks: 3 bytes
    per 128 KiB block plus a frame header and checksum, per plane)."""
    return _HEADER + nbytes + (nbytes >> 8) + MAX_PLANES * (_PLANE + 512)


def squeeze(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (contiguous), cut into planes, each compressed: a uint8 tensor to send."""
    k = t.element_size()
    if k > MAX_PLANES:
        raise ValueError(f"squeeze takes elements of at most {MAX_PLANES} bytes, got {t.dtype} ({k} bytes)")
    planes = np.ascontiguousarray(t.reshape(-1).view(torch.uint8).numpy().reshape(-1, k).T)
    codec = zstandard.ZstdCompressor(compression_params=_PARAMS)  # a compressor per call: threads may share none
    frames = [codec.compress(plane) for plane in planes]
    msg = bytearray((k * _PLANE + sum(map(len, frames))).to_bytes(_HEADER, "little"))
    for f in frames:
        msg += len(f).to_bytes(_PLANE, "little")
    for f in frames:
        msg += f  # one copy of each frame: the tensor shares the bytearray's memory
    return torch.frombuffer(msg, dtype=torch.uint8)


def wire_bytes(buf: torch.Tensor) -> int:
    """The bytes the message received into `buf` took on the wire (header included)."""
    return _HEADER + int.from_bytes(buf[:_HEADER].numpy().tobytes(), "little")


def unsqueeze(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Decode the message received into `buf` (a prefix of it) into `out` (contiguous, the sender's
    shape and dtype); SqueezeError when it is not a whole, intact message of `out`'s size. Every
    plane is decoded and checked before anything is written."""
    n, k = wire_bytes(buf) - _HEADER, out.element_size()
    if not k * _PLANE <= n <= buf.numel() - _HEADER:
        raise SqueezeError(f"squeezed message claims {n} bytes, the buffer holds {buf.numel() - _HEADER} "
                           f"(and {k} planes need at least {k * _PLANE})")
    body = buf[_HEADER:_HEADER + n].numpy()
    lengths = np.frombuffer(body[:k * _PLANE].tobytes(), dtype="<u4").astype(np.int64)
    if int(lengths.sum()) != n - k * _PLANE:
        raise SqueezeError(f"squeezed message's {k} planes take {int(lengths.sum())} bytes, it holds {n - k * _PLANE}")
    ends = k * _PLANE + np.cumsum(lengths)
    planes = [_plane(body[e - m:e], out.numel()) for m, e in zip(lengths, ends)]
    dst = out.reshape(-1).view(torch.uint8).numpy().reshape(-1, k)
    for p, plane in enumerate(planes):
        dst[:, p] = np.frombuffer(plane, dtype=np.uint8)  # plane by plane: 5x faster than one transposed copy


def _plane(frame: np.ndarray, want: int) -> bytes:
    """One plane's frame decoded: `want` bytes, or SqueezeError."""
    try:
        plane = zstandard.ZstdDecompressor().decompress(memoryview(frame), max_output_size=want)
    except zstandard.ZstdError as e:
        raise SqueezeError(f"squeezed message does not decode: {e}") from e
    if len(plane) != want:
        raise SqueezeError(f"squeezed message decodes to {len(plane)} bytes per plane, expected {want}")
    return plane
