"""Data loading whose batches are addressed by global step (see loader.py)."""
from unbroken.data.loader import StepLoader

__all__ = ["StepLoader"]
