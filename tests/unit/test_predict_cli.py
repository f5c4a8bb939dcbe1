"""`unbroken predict` and `unbroken predict profile`: bad input is one line and exit 2; the collector's schema."""
from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from unbroken.predict import measurements, profile as prof
from unbroken.predict.command import predict_app


def _specs():
    from unbroken.predict import tables
    return tables.load_gpus(), tables.load_models()


def _run(*args):
    return CliRunner().invoke(predict_app, [str(a) for a in args])


def _one_line_exit_2(res, *needles):
    assert res.exit_code == 2, res.output
    out = res.output.strip()
    assert out.startswith("error:") and "Traceback" not in out
    for n in needles:
        assert n in out, out


def test_registered_in_the_main_cli():
    from unbroken.cli import app, bench_app

    assert "predict" in {g.name for g in app.registered_groups}
    assert "predict" in {c.name for c in bench_app.registered_commands}


def test_unknown_gpu_names_the_tables_and_the_fix():
    _one_line_exit_2(_run("--gpu", "TPU v5e", "--model", "meta-llama/Meta-Llama-3.1-8B"),
                     "gpu_features.csv", "gpu_specs_extra.csv", "--gpu-specs")


def test_unknown_model_names_the_tables_and_the_fix():
    _one_line_exit_2(_run("--gpu", "A100", "--model", "acme/nope-3b"), "model_features.csv", "--model-specs")


def test_spec_file_with_impossible_units(tmp_path):
    f = tmp_path / "mine.csv"
    f.write_text("gpu_type;memory_bandwidth_gb_s;memory_size_gb;thermal_design_power_w;tensor_tflops\n"
                 "Mine;2000;80;500;9.89e14\n")
    _one_line_exit_2(_run("--gpu", "Mine", "--model", "meta-llama/Meta-Llama-3.1-8B", "--gpu-specs", f),
                     "tensor_tflops", "unit")


def test_missing_arguments_and_files():
    _one_line_exit_2(_run(), "--model")
    _one_line_exit_2(_run("--model", "meta-llama/Meta-Llama-3.1-8B"), "--gpu", "--rank")
    _one_line_exit_2(_run("--check", "/nonexistent/m.jsonl"), "no such file")
    _one_line_exit_2(_run("--gpu", "A100", "--model", "meta-llama/Meta-Llama-3.1-8B", "--scenario", "weird"), "scenario")


def test_bench_rejects_an_unknown_evaluation(tmp_path):
    import typer

    from unbroken.bench.predict import predict as bench

    app = typer.Typer()
    app.command()(bench)
    res = CliRunner().invoke(app, ["--only", "mlperf", "--out-dir", str(tmp_path)])
    _one_line_exit_2(res, "mlperf", "llm-inference-bench")
    for bad in ("0", "5,x", "-1"):
        res = CliRunner().invoke(app, ["--shots", bad, "--out-dir", str(tmp_path)])
        _one_line_exit_2(res, "--shots", "1,5,20")


def test_profile_writes_the_measurement_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "RAPL", tmp_path / "no-powercap")
    out = tmp_path / "p"
    res = _run("profile", "--gpu", "A100", "--out", out, "--batch", "2", "--tokens", "3", "--layers", "1",
               "--width", "64", "--device", "cpu")
    assert res.exit_code == 0, res.output
    (m,) = measurements.load_user(out / "measurements.jsonl")
    assert m.dataset == "profile" and m.batch == 2 and m.itl_s > 0 and math.isnan(m.power_w)
    spec_lines = (out / "model_specs.csv").read_text().splitlines()
    assert spec_lines[0].startswith("model_name;") and spec_lines[1].startswith(m.model + ";")
    assert json.loads((out / "measurements.jsonl").read_text())["power_w"] is None


def test_profile_like_times_a_replica_of_a_table_model(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "RAPL", tmp_path / "no-powercap")
    out = tmp_path / "p"
    res = _run("profile", "--gpu", "A100", "--out", out, "--like", "openai-community/gpt2", "--batch", "1",
               "--tokens", "3", "--prompt-tokens", "5", "--dtype", "float32", "--device", "cpu")
    assert res.exit_code == 0, res.output
    (m,) = measurements.load_user(out / "measurements.jsonl")
    assert (m.model, m.scenario, m.framework, m.prompt_tokens, m.output_tokens) == \
        ("openai-community/gpt2", "single", "transformers", 5, 3)
    assert m.itl_s > 0 and not (out / "model_specs.csv").exists()  # the model is in the tables already


def test_profile_bad_input_is_one_line(tmp_path):
    _one_line_exit_2(_run("profile", "--gpu", "A100", "--out", tmp_path, "--like", "acme/no-such-llm",
                          "--device", "cpu"), "acme/no-such-llm", "--model-specs")
    _one_line_exit_2(_run("profile", "--gpu", "A100", "--out", tmp_path, "--dtype", "int8"), "--dtype")
    _one_line_exit_2(_run("profile", "--gpu", "A100", "--out", tmp_path, "--device", "tpu"), "--device")


def test_rapl_counters_sum_packages_not_subzones(tmp_path, monkeypatch):
    for zone, uj in (("intel-rapl:0", 1000), ("intel-rapl:1", 500), ("intel-rapl:0:0", 7)):
        (tmp_path / zone).mkdir()
        (tmp_path / zone / "energy_uj").write_text(f"{uj}\n")
    monkeypatch.setattr(prof, "RAPL", tmp_path)
    assert prof.rapl_energy_uj() == 1500
    monkeypatch.setattr(prof, "RAPL", tmp_path / "absent")
    assert prof.rapl_energy_uj() is None


def test_check_compares_predictions_with_measurements(tmp_path, monkeypatch):
    from unbroken.predict import models, service

    rows = measurements.load_ml_energy_v2()
    fast = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3)
    monkeypatch.setattr(service, "training_table", lambda g, m, extra: service.build(rows[:150] + list(extra), g, m))
    monkeypatch.setattr(service, "train_cached", lambda table: service.train(table, config=fast, k=3))
    f = tmp_path / "mine.jsonl"
    f.write_text(measurements.to_json_line(rows[200]) + "\n")
    res = _run("--check", f)
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if "measured" in ln]
    assert len(lines) == 2 and "power_w" in lines[0] and "itl_s" in lines[1]
    assert all(("inside" in ln) or ("outside" in ln) for ln in lines)
    assert "power_w: MdAPE" in res.output and "itl_s: MdAPE" in res.output
    doc = json.loads(_run("--check", f, "--json").stdout)
    assert {r["target"] for r in doc["rows"]} == {"power_w", "itl_s"} and "commit" in doc
    for r in doc["rows"]:
        assert r["error"] == (r["predicted"] - r["measured"]) / r["measured"]
        assert doc["summary"][r["target"]] == {"n": 1, "mdape": abs(r["error"]) * 100, "coverage": float(r["inside"])}


def test_token_lengths_reach_the_operating_point(monkeypatch):
    from unbroken.predict import models, service

    rows = measurements.load_ml_energy_v2()
    fast = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3)
    monkeypatch.setattr(service, "training_table", lambda g, m, extra: service.build(rows[:150] + list(extra), g, m))
    monkeypatch.setattr(service, "train_cached", lambda table: service.train(table, config=fast, k=3))
    seen, estimate = [], service.estimate
    monkeypatch.setattr(service, "estimate", lambda t, g, m, op, usd=None: seen.append(op) or estimate(t, g, m, op, usd))
    res = _run("--gpu", "H100 SXM", "--model", "meta-llama/Meta-Llama-3.1-8B", "--prompt-tokens", "512",
               "--output-tokens", "256", "--json")
    assert res.exit_code == 0, res.output
    assert (seen[-1].prompt_tokens, seen[-1].output_tokens) == (512.0, 256.0)
    res = _run("--gpu", "H100 SXM", "--model", "meta-llama/Meta-Llama-3.1-8B", "--json")
    assert res.exit_code == 0 and math.isnan(seen[-1].prompt_tokens) and math.isnan(seen[-1].output_tokens)
    res = _run("--gpu", "H100 SXM", "--model", "meta-llama/Meta-Llama-3.1-8B", "--output-tokens", "0")
    assert res.exit_code == 2 and "output_tokens must be > 0" in res.output and "Traceback" not in res.output


def test_a_length_no_training_row_of_the_setup_recorded_is_read_as_unknown(monkeypatch):
    from unbroken.predict import models, service

    rows = measurements.load_ml_energy_v2()  # vLLM, server: output lengths, no prompt lengths
    fast = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3)
    monkeypatch.setattr(service, "training_table", lambda g, m, extra: service.build(rows[:150] + list(extra), g, m))
    monkeypatch.setattr(service, "train_cached", lambda table: service.train(table, config=fast, k=3))
    base = ("--gpu", "H100 SXM", "--model", "meta-llama/Meta-Llama-3.1-8B", "--output-tokens", "256")
    given, plain = (json.loads(_run(*base, *extra, "--json").stdout) for extra in (("--prompt-tokens", "512"), ()))
    assert given["lengths_ignored"] == ["prompt_tokens"] and plain["lengths_ignored"] == []
    assert given["itl_s"] == plain["itl_s"] and given["power_w"] == plain["power_w"]
    res = _run(*base, "--prompt-tokens", "512")
    assert res.exit_code == 0 and "prompt tokens read as unknown" in " ".join(res.output.split())
    # a setup the training rows never ran keeps what it was given: nothing says it is not informative
    offline = json.loads(_run(*base, "--prompt-tokens", "512", "--scenario", "offline", "--json").stdout)
    assert offline["lengths_ignored"] == []


def test_recorded_lengths_and_as_trained():
    from unbroken.predict import service
    from unbroken.predict.features import OperatingPoint

    trained = service.Trained(power=None, itl=None, n_power_rows=0, n_itl_rows=0,
                              lengths={("transformers", "single"): frozenset({"output_tokens"})})
    op = OperatingPoint(prompt_tokens=64.0, output_tokens=256.0, scenario="single", framework="transformers")
    got, ignored = trained.as_trained(op)
    assert ignored == ("prompt_tokens",) and math.isnan(got.prompt_tokens) and got.output_tokens == 256.0
    assert trained.as_trained(OperatingPoint(output_tokens=9.0, scenario="single", framework="transformers"))[1] == ()
    assert trained.as_trained(OperatingPoint(prompt_tokens=64.0)) == (OperatingPoint(prompt_tokens=64.0), ())
    table = service.build(measurements.load_ml_energy_v2()[:3] + measurements.load_ml_energy_legacy()[:3],
                          *_specs())
    assert service.recorded_lengths(table) == {("vLLM", "server"): frozenset({"output_tokens"}),
                                               ("transformers", "single"): frozenset({"output_tokens"})}


def test_a_malformed_measurement_file_is_one_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"gpu": "A100"}\n')
    _one_line_exit_2(_run("--gpu", "A100", "--model", "meta-llama/Meta-Llama-3.1-8B", "--measurements", f),
                     "bad.jsonl:1", "unbroken predict profile")


def test_bench_seed_reaches_every_search_config(tmp_path, monkeypatch):
    import typer

    from unbroken.bench import predict as bp

    seen = []
    balanced = []
    transfers, per_framework = [], []
    monkeypatch.setattr(bp, "_run_one", lambda table, target, grid, console, balance, transfer, framework_laws:
                        seen.append(grid) or balanced.append(balance) or transfers.append(transfer)
                        or per_framework.append(framework_laws) or {})
    monkeypatch.setattr(bp, "_figure", lambda results, path: None)
    shots = []
    monkeypatch.setattr(bp, "_few_shot", lambda table, target, grid, counts, balance, console, transfer, framework_laws:
                        shots.append(counts) or transfers.append(transfer) or per_framework.append(framework_laws)
                        or {})
    app = typer.Typer()
    app.command()(bp.predict)
    res = CliRunner().invoke(app, ["--only", "ml-energy", "--seed", "7", "--trees", "10", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen and all(c.seed == 7 and c.n_estimators >= 1 for grid in seen for c in grid)
    assert len(seen[0]) == len(bp.SEARCH_GRID)
    assert balanced and all(balanced)  # GPU-balanced weights unless --no-balance
    assert shots and all(c == bp.SHOTS for c in shots)
    assert transfers and all(transfers)  # sibling transfer offered unless --no-siblings
    assert per_framework and all(per_framework)  # and an alpha per framework unless --one-law
    assert json.loads((tmp_path / "predict.json").read_text())["framework_laws"] is True
    res = CliRunner().invoke(app, ["--only", "ml-energy", "--trees", "10", "--no-balance", "--shots", "",
                                   "--no-siblings", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert balanced[-1] is False and len(shots) == 2  # '' runs no few-shot split (2 targets before)
    assert transfers[-1] is False
    record = json.loads((tmp_path / "predict.json").read_text())
    assert record["few_shot_logo"] == {} and record["sibling_transfer"] is False and record["framework_laws"] is False
    res = CliRunner().invoke(app, ["--only", "ml-energy", "--trees", "10", "--shots", "", "--one-law",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert transfers[-1] is True and per_framework[-1] is False
    assert json.loads((tmp_path / "predict.json").read_text())["framework_laws"] is False
