"""The embedded corpus and the deterministic sampler.

A batch is a pure function of (seed, step, rank, world_size): any process,
including a shadow started minutes later, draws exactly the same tokens.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

import numpy as np
import torch

# Fixed alphabet: printable ASCII plus newline. Independent of the corpus text.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}


class Corpus:
    """The corpus as a uint8 token array."""

    def __init__(self, text: str) -> None:
        unknown = sorted({c for c in text if c not in _INDEX})
        if unknown:
            raise ValueError(f"corpus has characters outside the alphabet: {unknown[:5]!r}; use printable ASCII")
        self.tokens = torch.from_numpy(np.frombuffer(text.encode("ascii"), dtype=np.uint8).copy())
        lut = torch.zeros(256, dtype=torch.long)
        for c, i in _INDEX.items():
            lut[ord(c)] = i
        self.tokens = lut[self.tokens.long()]

    @staticmethod
    @lru_cache(maxsize=1)
    def embedded() -> "Corpus":
        text = resources.files("unbroken.models").joinpath("corpus.txt").read_text(encoding="ascii")
        return Corpus(text)

    def __len__(self) -> int:
        return int(self.tokens.numel())


def batch_for(corpus: Corpus, *, seed: int, step: int, rank: int, world_size: int,
              batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (batch_size, seq_len) for this rank at this step."""
    assert 0 <= rank < world_size, f"rank {rank} outside world of {world_size}"
    gen = torch.Generator().manual_seed(_mix(seed, step))
    starts = torch.randint(0, len(corpus) - seq_len - 1, (world_size * batch_size,), generator=gen)
    mine = starts[rank * batch_size:(rank + 1) * batch_size]
    idx = mine[:, None] + torch.arange(seq_len + 1)[None, :]
    window = corpus.tokens[idx]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _mix(seed: int, step: int) -> int:
    # SplitMix64-style mixing so that neighbouring (seed, step) pairs are unrelated.
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
