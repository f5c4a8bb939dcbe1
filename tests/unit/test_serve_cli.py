"""`unbroken serve` and `unbroken bench serve`: user mistakes are one line and exit 2."""
from typer.testing import CliRunner

from unbroken.cli import app


def test_serve_mistakes_are_one_line_exit_2(tmp_path):
    runner = CliRunner()
    cases = [(["serve", "run", "--adapters", str(tmp_path / "none")], "is not a directory"),
             (["serve", "run", "--adapters", str(tmp_path), "--slots", "64", "--max-rank", "64", "--memory-mb", "8"],
              "over memory_mb"),
             (["serve", "fleet", "--adapters", str(tmp_path)], "no adapters under"),
             (["serve", "adapters", "--out", str(tmp_path), "--count", "0"], "need n >= 1"),
             (["bench", "serve", "--duration", "0"], "--duration must be")]
    for args, text in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert text in r.output and "Traceback" not in r.output, (args, r.output)


def test_serve_adapters_writes_peft_files(tmp_path):
    r = CliRunner().invoke(app, ["serve", "adapters", "--out", str(tmp_path), "--count", "3"])
    assert r.exit_code == 0, r.output
    assert len(list(tmp_path.glob("*/adapter_model.safetensors"))) == 3
