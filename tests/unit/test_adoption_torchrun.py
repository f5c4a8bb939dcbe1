"""The adoption benchmark's torchrun reference: a run that wrote its result whole and then died at
exit is taken (with a warning); one that did not is retried once, from a clean slate."""
from __future__ import annotations

import pytest
import torch

from unbroken.bench import adoption


def _launcher(outcomes: list, result):
    """A stand-in for run_launcher: each call writes (or not) the result, then fails (or not)."""
    calls = []

    def run(cmd, log, cwd, timeout_s, env_extra=None):
        write, fail = outcomes[len(calls)]
        calls.append(log.name)
        if write == "whole":
            torch.save({"w": torch.ones(3)}, result)
        elif write == "cut":
            result.write_bytes(b"PK\x03\x04 cut short")
        if fail:
            raise RuntimeError("torchrun exited -6")
    return run, calls


def test_a_result_written_whole_before_a_crash_at_exit_is_taken(tmp_path, monkeypatch):
    result = tmp_path / "plain.pt"
    run, calls = _launcher([("whole", True)], result)
    monkeypatch.setattr(adoption, "run_launcher", run)
    with pytest.warns(RuntimeWarning, match="wrote plain.pt whole, then failed at exit"):
        adoption.run_torchrun("s.py", [], tmp_path / "plain.log", tmp_path, result=result)
    assert calls == ["plain.log"]


@pytest.mark.parametrize("write", ["cut", "none"])
def test_a_run_without_a_whole_result_is_retried_once_and_a_second_failure_raises(tmp_path, monkeypatch, write):
    result = tmp_path / "plain.pt"
    run, calls = _launcher([(write, True), ("none", True)], result)
    monkeypatch.setattr(adoption, "run_launcher", run)
    with pytest.warns(RuntimeWarning, match="retried after"), pytest.raises(RuntimeError, match="exited -6"):
        adoption.run_torchrun("s.py", [], tmp_path / "plain.log", tmp_path, result=result)
    assert calls == ["plain.log", "plain.retry.log"] and not result.exists()  # the cut file was not kept
