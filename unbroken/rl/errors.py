"""The RL application's user-input error: one line naming the problem and the fix (exit 2 at the CLI)."""
from __future__ import annotations


class RLInputError(ValueError):
    """Bad user input for `unbroken rl` / `unbroken bench rl`: a pool of size 0, too many processes,
    a reward function that raises or returns a non-number."""
