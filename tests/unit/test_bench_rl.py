"""`unbroken bench rl`: the methods it compares, and (slow) a quick run's JSON."""
import json

import pytest
from typer.testing import CliRunner

from unbroken.bench.rl import even_name, methods


def test_every_static_split_colocated_and_dynamic():
    assert [m[0] for m in methods(4)] == ["static-1r3t", "static-2r2t", "static-3r1t", "colocated", "dynamic"]
    assert even_name(4) == "static-2r2t" and dict((n, r) for n, _, r in methods(4))["dynamic"] == 2


@pytest.mark.slow
def test_quick_bench_writes_consistent_json(tmp_path):
    import typer

    from unbroken.bench.rl import rl

    app = typer.Typer()
    app.command()(rl)
    res = CliRunner().invoke(app, ["--quick", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "rl.json").read_text())
    sps = out["samples_per_s"]
    assert out["speedup_vs_best_static"] == pytest.approx(sps["dynamic"] / sps[out["best_static"]])
    assert out["speedup_vs_even"] == pytest.approx(sps["dynamic"] / sps["static-2r2t"])
    assert set(out["reward_final"]) == set(sps) and "commit" in out and (tmp_path / "rl.png").exists()
