"""Model buffers (BatchNorm running statistics, counters) kept consistent the way DDP does.

DDP broadcasts rank 0's buffers before every forward, so every rank starts step t with
the buffers rank 0 had after step t-1. unbroken gives the same values and makes them
survive a failure: rank 0's buffers after its forward of step t travel in step t's
gradient all-reduce (encoded as 16-bit integers in float32 slots, which every other
rank fills with zeros: the sum is exact for any dtype, -0.0 and NaN included), so
whoever holds step t's averaged gradient also holds them. At commit every rank adopts
them; before each forward (first attempt or redo) the live buffers are reset to the
committed ones, so a redone forward never counts a batch twice.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn


class ModelBuffers:
    def __init__(self, model: nn.Module) -> None:
        self.buffers = [b for _, b in model.named_buffers()]
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers)
        self.words = (self.nbytes + 1) // 2  # one 16-bit word per float32 slot
        self.committed = torch.zeros(self.words)  # the encoded buffers of the last committed step
        if self.words:
            self.encode(self.committed)

    def encode(self, out: torch.Tensor) -> None:
        """Write the live buffers' bytes into `out` (words float32 slots, each an integer < 2**16)."""
        raw = torch.zeros(2 * self.words, dtype=torch.uint8)
        off = 0
        for b in self.buffers:
            n = b.numel() * b.element_size()
            raw[off:off + n].copy_(b.detach().reshape(-1).contiguous().view(torch.uint8))
            off += n
        out.copy_(raw.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).to(torch.float32))

    def decode(self, words: torch.Tensor) -> None:
        """Set the live buffers from encoded `words`."""
        with torch.no_grad():
            for b, v in zip(self.buffers, decode_words(words, [(b.dtype, b.shape) for b in self.buffers])):
                b.copy_(v)

    def restore(self) -> None:
        """Live buffers back to the committed ones (before a forward)."""
        if self.words:
            self.decode(self.committed)

    def commit(self, words: torch.Tensor) -> None:
        """Adopt `words` (rank 0's buffers of the step being committed) as committed and live."""
        if self.words:
            self.committed.copy_(words)
            self.decode(self.committed)


def decode_words(words: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The tensors `ModelBuffers.encode` packed into `words`, one per (dtype, shape) in `specs`
    (the buffers in `model.named_buffers()` order): views into one fresh byte tensor, or copies
    where a buffer's bytes start unaligned for its dtype (e.g. after an odd-length float16 one)."""
    raw = words.to(torch.int32).to(torch.int16).view(torch.uint8)
    out, off = [], 0
    for dtype, shape in specs:
        n = math.prod(shape) * dtype.itemsize
        piece = raw[off:off + n]
        out.append((piece if off % dtype.itemsize == 0 else piece.clone()).view(dtype).view(shape))
        off += n
    return out
