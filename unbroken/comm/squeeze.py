"""Lossless compression of the bytes that cross a slow link (a "squeezed" message).

A link planned around because it is slow (comm/adaptive.py) still has to carry the slow rank's own
bytes: its whole tensor out in the reduce-scatter and the whole result in during the all-gather,
which bounds any re-plan at 2(N-1)/N of the static ring's time on it (1.5x at 4 ranks). The CPU
beside such a link is mostly idle, so the direct exchange (comm/patterns.py) may send those bytes
compressed: the element bytes are shuffled into planes (every element's byte 0, then every byte 1,
...; the sign and exponent bytes of floats are few-valued) and each plane run through zstd level 1
(python-zstandard). Lossless: the receiver gets the same bits, so every pattern still equals the
reference reduction bit for bit. On normal float32 values it sends 1/1.19 of the bytes, bfloat16
1/1.46, and one core compresses and decodes a few hundred MB/s of float32 on this AMD EPYC host
(`unbroken bench collectives --only codec`, the `codec` section of bench/results/collectives.json);
a link is squeezed only below SQUEEZE_BELOW_BPS, where the codec costs a fraction of the wire time
it saves.

A message is an 8-byte little-endian frame length, then the zstd frame (with its checksum). The
receiver posts a buffer of `bound(nbytes)` (gloo fills a prefix of a larger receive buffer) and
`unsqueeze` checks the length, the frame's checksum and its size before writing the destination.
"""
from __future__ import annotations

import numpy as np
import torch
import zstandard

SQUEEZE_BELOW_BPS = 50e6  # links slower than this (bytes/s, 400 Mbit/s) carry squeezed messages: a fraction of the codec's speed
LEVEL = 1  # zstd's fastest level that still finds the exponent planes' redundancy (1.19x vs 1.10x at -1)
_HEADER = 8


class SqueezeError(RuntimeError):
    """A squeezed message did not decode to what was expected (length, checksum or size)."""


def bound(nbytes: int) -> int:
    """The largest message `squeeze` makes of `nbytes` (zstd's worst case is stored blocks: 3 bytes
    per 128 KiB block plus a frame header and checksum)."""
    return _HEADER + nbytes + (nbytes >> 8) + 512


def squeeze(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (contiguous), shuffled into planes and compressed: a uint8 tensor to send."""
    raw = t.reshape(-1).view(torch.uint8).numpy()
    planes = np.ascontiguousarray(raw.reshape(-1, t.element_size()).T)
    frame = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True).compress(planes)
    msg = bytearray(len(frame).to_bytes(_HEADER, "little"))
    msg += frame  # one copy of the frame: the tensor shares the bytearray's memory
    return torch.frombuffer(msg, dtype=torch.uint8)


def wire_bytes(buf: torch.Tensor) -> int:
    """The bytes the message received into `buf` took on the wire (header included)."""
    return _HEADER + int.from_bytes(buf[:_HEADER].numpy().tobytes(), "little")


def unsqueeze(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Decode the message received into `buf` (a prefix of it) into `out` (contiguous, the sender's
    shape and dtype); SqueezeError when it is not a whole, intact message of `out`'s size."""
    n = wire_bytes(buf) - _HEADER
    if not 0 < n <= buf.numel() - _HEADER:
        raise SqueezeError(f"squeezed message claims {n} bytes, the buffer holds {buf.numel() - _HEADER}")
    want = out.numel() * out.element_size()
    try:
        planes = zstandard.ZstdDecompressor().decompress(memoryview(buf[_HEADER:_HEADER + n].numpy()),
                                                         max_output_size=want)
    except zstandard.ZstdError as e:
        raise SqueezeError(f"squeezed message does not decode: {e}") from e
    if len(planes) != want:
        raise SqueezeError(f"squeezed message decodes to {len(planes)} bytes, expected {want}")
    dst = out.reshape(-1).view(torch.uint8).numpy().reshape(-1, out.element_size())
    dst[:] = np.frombuffer(planes, dtype=np.uint8).reshape(out.element_size(), -1).T
