"""How every command reports a user mistake: one red line on stderr, exit status 2."""
from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """Print `error: message` (say what is wrong and how to fix it) and exit with status 2."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)
