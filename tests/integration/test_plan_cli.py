"""`unbroken plan` through the CLI, from a saved topology and profile (fast: nothing is measured)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from unbroken.plan.profile import parse_model

from ..unit.test_plan import _profile, _swept

pytestmark = pytest.mark.timeout(120)


def _files(tmp_path, world: int = 4):
    model = parse_model("small")
    prof = _profile(model=dataclasses.asdict(model), batch_size=8, ranks_per_host=world)
    (tmp_path / "profile.json").write_text(json.dumps(prof.to_dict()))
    _swept(world, 1e-8).save(tmp_path / "topo.json")
    return ["--model", "small", "--profile", str(tmp_path / "profile.json"), "--topology", str(tmp_path / "topo.json")]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unbroken.cli", "plan", *args], capture_output=True, text=True,
                          timeout=100)


def test_plan_prints_every_strategy_and_a_choice_that_fits(tmp_path):
    files = _files(tmp_path)
    out = _plan(*files, "--world-size", "4", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    preds = {p["strategy"]: p for p in doc["predictions"]}
    assert set(preds) == {"ddp", "zero1", "zero2", "zero3"}
    assert doc["chosen"] == min(preds, key=lambda s: preds[s]["step_s"])
    smallest = min(p["peak_bytes"] for p in preds.values())
    limited = json.loads(_plan(*files, "--world-size", "4", "--json", "--memory-limit", str(smallest / 1e9)).stdout)
    assert preds[limited["chosen"]]["peak_bytes"] <= smallest


@pytest.mark.parametrize("args, needle", [
    (["--world-size", "4", "--strategy", "zero4"], "unknown strategy 'zero4'"),
    (["--world-size", "1", "--strategy", "zero3"], "nothing to shard over"),
    (["--world-size", "2"], "measured on 4 ranks"),
    (["--world-size", "4", "--memory-limit", "1e-9"], "no strategy fits"),
    (["--world-size", "4", "--memory-limit", "0.0031", "--strategy", "zero3"], "over --memory-limit"),
])
def test_bad_plans_are_one_line_exit_2(tmp_path, args, needle):
    out = _plan(*_files(tmp_path), *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr
