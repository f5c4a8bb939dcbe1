"""`unbroken rl train`: bad input (a pool of size 0, too many processes, a reward function that raises
or returns a non-number) is one line and exit 2; a run writes its result."""
import json

import pytest
from typer.testing import CliRunner

from unbroken.rl.command import rl_app

TINY = ["--digits", "1", "--steps", "2", "--prompts", "2", "--group", "2", "--pretrain-steps", "2"]


def _run(*args):
    return CliRunner().invoke(rl_app, ["train", *map(str, args)])


def _one_line_exit_2(res, *needles):
    assert res.exit_code == 2, res.output
    out = res.output.strip()
    assert out.startswith("error:") and "Traceback" not in out and len(out.splitlines()) <= 3
    for n in needles:
        assert n in out.replace("\n", " "), out


def test_registered_in_the_main_cli():
    from unbroken.cli import app, bench_app

    assert "rl" in {g.name for g in app.registered_groups}
    assert "rl" in {c.name for c in bench_app.registered_commands}


@pytest.mark.parametrize("args,needles", [(["--processes", "4", "--rollout", "0"], ["pool of size 0"]),
                                          (["--processes", "4", "--rollout", "4"], ["pool of size 0"]),
                                          (["--processes", "100000"], ["machine's limit"]),
                                          (["--method", "nope"], ["unknown --method"]),
                                          (["--reward", "tests.integration.rl_rewards:missing"], ["cannot load"])])
def test_bad_input(args, needles, tmp_path):
    _one_line_exit_2(_run(*TINY, *args, "--out", tmp_path), *needles)


def test_reward_that_raises_in_one_process(tmp_path):
    res = _run(*TINY, "--processes", "1", "--reward", "tests.integration.rl_rewards:raises", "--out", tmp_path)
    _one_line_exit_2(res, "raised ZeroDivisionError")


def test_reward_that_returns_a_non_number_stops_the_pooled_run(tmp_path):
    res = _run(*TINY, "--processes", "2", "--reward", "tests.integration.rl_rewards:not_a_number", "--out", tmp_path)
    _one_line_exit_2(res, "returned '1.0'")


def test_single_process_run_writes_its_result(tmp_path):
    res = _run(*TINY, "--processes", "1", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "result.json").read_text())
    assert [c["step"] for c in out["curve"]] == [0, 1]
