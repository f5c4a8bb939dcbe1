"""Simulation results for people (a rich table) and for programs (one JSON object per policy per line)."""
from __future__ import annotations

import json
from typing import Any, Mapping, TextIO

from rich.console import Console
from rich.table import Table

from unbroken.sim.engine import RECOVERY_PHASES
from unbroken.sim.montecarlo import Summary

TABLE_PHASES = ("overhead", "redo", "checkpoint") + RECOVERY_PHASES


def json_lines(summaries: list[Summary], extra: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """One object per summary; `extra[policy]` adds keys (e.g. where its overhead came from)."""
    extra = extra or {}
    return "".join(json.dumps({**s.to_json(), **extra.get(s.policy, {})}) + "\n" for s in summaries)


def table(summaries: list[Summary], title: str) -> Table:
    """Net ETTR with its 95% interval, the gross ETTR and overhead behind it, failures, and hours
    spent in each account (mean over seeds)."""
    t = Table(title=title, title_justify="left")
    t.add_column("policy")
    t.add_column("ETTR", justify="right")
    t.add_column("95% CI", justify="right")
    t.add_column("gross", justify="right")
    t.add_column("overhead", justify="right")
    t.add_column("failures", justify="right")
    t.add_column("MTTF h", justify="right")
    t.add_column("tier-2", justify="right")
    for p in TABLE_PHASES:
        t.add_column(f"{p} h", justify="right")
    for s in summaries:
        t.add_row(s.policy, f"{100 * s.ettr:.2f}%", f"{100 * s.ettr_low:.2f}-{100 * s.ettr_high:.2f}",
                  f"{100 * s.ettr_gross:.2f}%", f"{100 * s.overhead:.1f}%",
                  f"{s.failures:.1f}", f"{s.mttf_h:.3g}", f"{s.tier2:.1f}",
                  *(f"{s.phases_h[p]:.2f}" for p in TABLE_PHASES))
    return t


def print_table(summaries: list[Summary], title: str, out: TextIO | None = None) -> None:
    Console(file=out, width=200).print(table(summaries, title))
