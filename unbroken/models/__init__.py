"""Tiny char-level GPT and the embedded corpus it trains on."""
from unbroken.models.data import VOCAB_SIZE, Corpus, batch_for
from unbroken.models.gpt import TinyGPT

__all__ = ["VOCAB_SIZE", "Corpus", "TinyGPT", "batch_for"]
