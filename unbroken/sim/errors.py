"""The simulator's one user-error type; `unbroken simulate` turns it into `error: ...` and exit 2."""
from __future__ import annotations


class SimError(ValueError):
    """A simulator input is wrong; the message names the value and what is allowed."""


def need(cond: bool, msg: str) -> None:
    """Raise `SimError(msg)` unless `cond` holds."""
    if not cond:
        raise SimError(msg)
