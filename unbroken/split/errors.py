"""The split application's user-input error: one line naming the problem and the fix."""
from __future__ import annotations


class SplitInputError(ValueError):
    """Bad user input for `unbroken split` / `unbroken bench split` (printed as one line, exit 2)."""
