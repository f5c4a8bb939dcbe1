"""A rank's protected state as fixed-size chunks over several equal-length 4-byte tensors.

Chunk c is element range [c*E, (c+1)*E) of every tensor (e.g. parameter shard, Adam m,
Adam v). Packed, a chunk is a (n_tensors, E) int32 block: the unit that parity covers,
that a transaction updates, and that recovery decodes.
"""
from __future__ import annotations

import hashlib

import torch


class ChunkedState:
    def __init__(self, tensors: list[torch.Tensor], chunk_elems: int) -> None:
        if not tensors:
            raise ValueError("ChunkedState needs at least one tensor")
        n = tensors[0].numel()
        for i, t in enumerate(tensors):
            if t.dim() != 1 or t.numel() != n or t.element_size() != 4 or not t.is_contiguous():
                raise ValueError(f"protected tensor {i} must be 1-D, contiguous, 4-byte dtype and {n} elements; "
                                 f"got shape {tuple(t.shape)} dtype {t.dtype}")
        if chunk_elems < 1 or n % chunk_elems:
            raise ValueError(f"chunk size {chunk_elems} must divide the protected length {n}")
        self.tensors = tensors
        self.words = [t.view(torch.int32) for t in tensors]
        self.chunk_elems = chunk_elems
        self.n_chunks = n // chunk_elems

    @property
    def chunk_shape(self) -> tuple[int, int]:
        return (len(self.tensors), self.chunk_elems)

    @property
    def chunk_bytes(self) -> int:
        return len(self.tensors) * self.chunk_elems * 4

    def _sl(self, c: int) -> slice:
        assert 0 <= c < self.n_chunks, f"chunk {c} out of range 0..{self.n_chunks - 1}"
        return slice(c * self.chunk_elems, (c + 1) * self.chunk_elems)

    def pack(self, c: int, out: torch.Tensor) -> torch.Tensor:
        sl = self._sl(c)
        for i, w in enumerate(self.words):
            out[i].copy_(w[sl])
        return out

    def unpack(self, c: int, src: torch.Tensor) -> None:
        sl = self._sl(c)
        for i, w in enumerate(self.words):
            w[sl].copy_(src[i])

    def empty_chunk(self) -> torch.Tensor:
        return torch.zeros(self.chunk_shape, dtype=torch.int32)

    def checksum(self, c: int) -> str:
        sl = self._sl(c)
        h = hashlib.blake2b(digest_size=16)
        for w in self.words:
            h.update(w[sl].numpy().tobytes())
        return h.hexdigest()

    def digest(self) -> str:
        h = hashlib.sha256()
        for w in self.words:
            h.update(w.numpy().tobytes())
        return h.hexdigest()
