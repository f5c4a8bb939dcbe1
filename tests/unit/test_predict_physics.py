"""unbroken predict's physical terms, the roofline-ratio target form, nested search and LOGO diagnostics."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from unbroken.predict import diagnostics, evaluate, features, measurements, models, siblings, tables
from unbroken.predict.dataset import build
from unbroken.predict.features import ROOFLINE, OperatingPoint

QUICK = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3)


@functools.cache
def _specs():
    return tables.load_gpus(), tables.load_models()


@pytest.fixture(scope="module")
def v2():
    """ML.ENERGY v2 (A100 and H100, vLLM), the rows with an ITL."""
    return build(measurements.load("ml-energy"), *_specs()).with_target("itl")


def _roofline_world(table, factor=3.0):
    """The same rows with ITL = factor x the per-token roofline: a world the ratio form fits exactly."""
    rows = [measurements.Measurement(**{**m.__dict__, "itl_s": factor * math.exp(r)})
            for m, r in zip(table.rows, table.X[:, ROOFLINE])]
    return build(rows, *_specs())


def test_kv_and_prefill_terms_by_hand():
    gpus, mods = _specs()
    a100, llama = gpus.get("A100"), mods.get("meta-llama/Llama-2-7b-hf")
    op = OperatingPoint(batch=1, prompt_tokens=128, output_tokens=128, scenario="offline")
    # K and V x 32 layers x 32 KV heads x 128 dims x 2 bytes = 524,288 B per token of context;
    # mean context 128 + 64 = 192 tokens; read at 1,560 GB/s
    assert features.kv_latency_s(a100, llama, op) == pytest.approx(524288 * 192 / 1560e9)
    # prefill: 2 x 6.74e9 x 128 prompt tokens at 312 TFLOPS, spread over 128 output tokens
    assert features.prefill_latency_s(a100, llama, op) == pytest.approx(2 * 6.74e9 * 128 / 312e12 / 128)
    weights = 2 * 6.74 / 1560
    assert features.roofline_s(a100, llama, op) == pytest.approx(
        2 * 6.74e9 / 312e12 + weights + 524288 * 192 / 1560e9)
    # unknown lengths: no prefill share, no KV term beyond what the known lengths give
    assert features.prefill_latency_s(a100, llama, OperatingPoint()) == 0.0
    assert features.kv_latency_s(a100, llama, OperatingPoint()) == 0.0


def test_a_mixtures_decode_reads_every_expert_its_batch_routes_to():
    """Mixtral-8x7B (46.7 B, 12.9 B active, 2 of 8 experts per token): batch 1 reads the active
    weights, batch 16 nearly all (8 x (1 - 0.75 ** 16) = 7.92 experts), and its roofline at batch 16
    streams them; a dense model reads its weights at any batch; the trees never see the counts."""
    gpus, mods = _specs()
    a100, llama = gpus.get("A100"), mods.get("meta-llama/Llama-2-7b-hf")
    mixtral = mods.get("mistralai/Mixtral-8x7B-v0.1")
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2) and math.isnan(llama.num_experts)
    expert = (46.7 - 12.9) / 6
    assert features.decode_read_b_params(46.7, 12.9, 8, 2, 1) == pytest.approx(12.9)
    at_16 = features.decode_read_b_params(46.7, 12.9, 8, 2, 16)
    assert at_16 == pytest.approx(12.9 + expert * (8 * (1 - 0.75 ** 16) - 2))
    compute = features.compute_latency_s(a100, mixtral, 1, 16)
    assert features.roofline_s(a100, mixtral, OperatingPoint(batch=16)) == pytest.approx(max(2 * at_16 / 1560, compute))
    assert features.bandwidth_latency_s(a100, mixtral, 1) == pytest.approx(2 * 12.9 / 1560)  # WattGPU's term
    assert features.decode_read_b_params(6.74, 6.74, math.nan, math.nan, 64) == 6.74
    names = [features.FEATURES[i] for i in features.TREE_COLUMNS]
    assert "num_experts" not in names and len(names) == len(features.FEATURES) - 2


@given(st.floats(1.0, 500.0), st.floats(0.01, 1.0), st.integers(2, 256), st.data())
def test_a_mixtures_read_grows_with_the_batch_from_active_to_total(total, share, experts, data):
    per_token = data.draw(st.integers(1, experts - 1))
    active = total * max(share, per_token / experts)  # the routed experts' share is at most 1 - k/E of the total
    batches = np.array([1.0, 2.0, 16.0, 1024.0, 1e6])
    read = features.decode_read_b_params(total, active, experts, per_token, batches)
    assert read[0] == pytest.approx(active) and read[-1] == pytest.approx(total, rel=1e-6)
    assert np.all(np.diff(read) >= -1e-9 * total) and np.all(read <= total * (1 + 1e-9))


@pytest.mark.parametrize("row, error", [({"num_experts": "8"}, "together"),
                                        ({"num_experts": "8", "experts_per_token": "9"}, "at most num_experts")])
def test_expert_counts_that_cannot_be_are_rejected(tmp_path, row, error):
    f = tmp_path / "m.csv"
    cols = {"model_name": "x/moe", "total_b_params": "40", "active_b_params": "10", "num_layers": "32",
            "hidden_size": "4096", "num_attention_heads": "32", "num_key_value_heads": "8", **row}
    f.write_text(";".join(cols) + "\n" + ";".join(cols.values()) + "\n")
    with pytest.raises(tables.SpecError, match=error):
        tables.load_models((f,))


@pytest.mark.parametrize("form", models.FORMS)
def test_target_forms_round_trip(v2, form):
    z = models.to_target("itl", v2.itl_s, v2.X, form)
    np.testing.assert_allclose(models.from_target("itl", z, v2.X, form), v2.itl_s, rtol=1e-12)
    assert models.forms_for("power") == ("direct",)


def test_ratio_form_extrapolates_to_an_unseen_gpu_where_direct_cannot(v2):
    world = _roofline_world(v2)
    a100 = world.gpu == "NVIDIA A100-SXM4-40GB"
    tr, te = np.flatnonzero(a100), np.flatnonzero(~a100)
    err = {}
    for form in models.FORMS:
        cfg = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3, target_form=form)
        p = models.fit(world.X[tr], world.itl_s[tr], "itl", grid=(cfg,), k=2)
        err[form] = models.mdape(p.predict(world.X[te])[0], world.itl_s[te])
    assert err["roofline_ratio"] < 0.1 and err["roofline_ratio"] * 10 < err["direct"]


def test_nested_search_under_logo_never_sees_the_held_out_gpu(v2, monkeypatch):
    bw = features.FEATURES.index("memory_bandwidth_gb_s")
    seen = []
    real = models.fit_xgb
    monkeypatch.setattr(models, "fit_xgb",
                        lambda X, z, cfg, w=None: seen.append(set(X[:, bw].tolist())) or real(X, z, cfg, w))
    grid = tuple(models.XgbConfig(n_estimators=5, max_depth=2, target_form=f) for f in models.FORMS)
    preds = evaluate.predict_held_out(v2, "itl", "logo", grid=grid)
    # 2 GPUs: every fit (inner folds, the search, the refit) sees exactly the one training GPU
    assert seen and all(len(s) == 1 for s in seen)
    assert preds["grouped"] is False  # one training GPU: the interval cannot be calibrated on GPU folds


def test_interval_knows_whether_it_was_group_calibrated(v2):
    p = models.fit(v2.X, v2.itl_s, "itl", groups=v2.gpu, grid=(QUICK,), k=2)
    one = v2.gpu == v2.gpu[0]
    q = models.fit(v2.X[one], v2.itl_s[one], "itl", groups=v2.gpu[one], grid=(QUICK,), k=2)
    assert p.grouped and not q.grouped


def test_offsets_recover_a_per_gpu_scale(v2):
    scale = np.where(v2.gpu == "NVIDIA A100-SXM4-40GB", 2.0, 0.5)
    d = diagnostics.gpu_offsets(v2, v2.itl_s, v2.itl_s * scale)
    assert d["per_gpu"]["NVIDIA A100-SXM4-40GB"]["offset"] == pytest.approx(0.5)
    assert d["per_gpu"]["NVIDIA H100 SXM5 80GB"]["mdape"] == pytest.approx(50.0)
    assert d["mdape_after_offsets"] == pytest.approx(0.0, abs=1e-9)


def test_roofline_efficiency_reads_the_factor(v2):
    eff = diagnostics.roofline_efficiency(_roofline_world(v2, factor=4.0))
    assert {g: v["vLLM"]["median"] for g, v in eff.items()} == pytest.approx(
        {"NVIDIA A100-SXM4-40GB": 4.0, "NVIDIA H100 SXM5 80GB": 4.0})


def test_power_bound_given_measured_itl_holds_out_the_group(monkeypatch):
    t = build(measurements.load("ml-energy"), *_specs()).with_target("power")
    seen = []
    real = diagnostics.fit_xgb
    weighted = []

    def spy(X, z, cfg, w=None):
        seen.append(len(z))
        weighted.append(w is not None)
        return real(X, z, cfg, w)

    monkeypatch.setattr(diagnostics, "fit_xgb", spy)
    out = diagnostics.power_given_measured_itl(t, "logo", QUICK)
    assert sorted(seen) == sorted(int((t.gpu != g).sum()) for g in set(t.gpu.tolist()))
    assert set(out["mdape_per_gpu"]) == set(t.gpu.tolist()) and 0 < out["mdape"] < 100
    assert weighted and all(weighted)  # the predictors' GPU-balanced weights, unless told otherwise
    diagnostics.power_given_measured_itl(t, "lolo", QUICK, balance=False)
    assert not any(weighted[len(set(t.gpu.tolist())):])


def test_power_fits_a_ratio_config_in_the_direct_form():
    t = build(measurements.load("ml-energy"), *_specs()).with_target("power")
    cfg = models.XgbConfig(n_estimators=5, max_depth=2, target_form="roofline_ratio")
    p = models.fit(t.X, t.target("power"), "power", grid=(cfg, models.replace(cfg, target_form="direct")), k=2)
    assert p.config.target_form == "direct" and p.config.max_depth == 2


@given(st.one_of(st.sampled_from(features.FRAMEWORKS), st.text(max_size=12)))
def test_framework_one_hot_is_nominal_and_unknown_is_missing(name):
    cols = features.framework_one_hot(name)
    assert list(cols) == [f"framework_is_{f}" for f in features.FRAMEWORKS]
    assert all(c in features.FEATURES for c in cols)
    v = np.array(list(cols.values()))
    if name in features.FRAMEWORKS:
        assert v.sum() == 1.0 and cols[f"framework_is_{name}"] == 1.0
    else:
        assert np.isnan(v).all()  # missing, not "none of the known ones"


def test_feature_row_carries_the_one_hot(v2):
    i = features.FEATURES.index("framework_is_vLLM")
    assert set(v2.X[:, i].tolist()) == {1.0}  # ML.ENERGY v2 ran vLLM only


def _scaled_world(alpha_of: dict[str, float], gpus=("A100", "H100 SXM", "MI300X")):
    """Llama-3.1-8B on `gpus` (by default two NVIDIA parts and an AMD part with no sibling), one
    framework per key of `alpha_of`: each configuration's ITL is a constant of its own times the GPU's
    roofline to the framework's power."""
    specs, _ = _specs()
    rows = [measurements.Measurement(dataset="toy", gpu=specs.get(g).name, model="meta-llama/Meta-Llama-3.1-8B",
                                     n_gpus=1, batch=float(b), prompt_tokens=128.0, output_tokens=128.0,
                                     scenario="offline", framework=f, power_w=math.nan, itl_s=1.0)
            for g in gpus for b in (1, 8, 64) for f in alpha_of]
    t = build(rows, *_specs())
    itl = [(1 + m.batch / 10) * r ** alpha_of[m.framework] for m, r in zip(rows, t.roofline_s)]
    return build([measurements.Measurement(**{**m.__dict__, "itl_s": v}) for m, v in zip(rows, itl)], *_specs())


def test_sibling_hindsight_finds_each_frameworks_alpha_and_skips_a_part_with_no_sibling(monkeypatch):
    monkeypatch.setattr(siblings, "SIBLING_MIN_ROWS", 1)  # toy parts of 3 rows per setup (real ones: 41 and more)
    d = diagnostics.sibling_hindsight(_scaled_world({"vLLM": 0.25, "llama.cpp": 1.0}))
    assert set(d["per_gpu"]) == {"NVIDIA A100-SXM4-40GB", "NVIDIA H100 SXM5 80GB"}  # the MI300X has no sibling
    for g in d["per_gpu"].values():
        assert g["hindsight"]["alpha"] == {"vLLM": 0.25, "llama.cpp": 1.0}
        assert g["hindsight"]["mdape"] == pytest.approx(0.0, abs=1e-6) and g["configurations"] == 6
        # held out, the A100 leaves the H100 no pair to learn from (and the other way round)
        assert g["from_other_gpus"]["alpha"] == {"vLLM": None, "llama.cpp": None}
        # the offset law, tried beside: a world of pure ratio laws, where it is the worse one
        assert set(g["offset"]["hindsight"]["c"]) == {"vLLM", "llama.cpp"} and g["offset"]["hindsight"]["mdape"] > 1
        # the specs law: two exponents, [bandwidth, TFLOPS], per framework
        assert all(len(e) == 2 for e in g["specs"]["hindsight"]["exponents"].values())
    assert d["configurations"] == 12 and d["from_other_gpus"]["mdape"] is None
    assert d["offset"]["hindsight"]["mdape"] > 1 and d["offset"]["from_other_gpus"]["mdape"] is None
    assert d["specs"]["from_other_gpus"]["mdape"] is None
    # an alpha outside the offered grid leaves an error, measured from the sibling's own ITL
    off = diagnostics.sibling_hindsight(_scaled_world({"vLLM": 2.5}))
    assert off["hindsight"]["mdape"] > 10
    assert all(g["hindsight"]["alpha"] == {"vLLM": 1.5} for g in off["per_gpu"].values())


def test_sibling_alpha_from_other_gpus_carries_over_in_a_world_of_one_alpha_and_not_in_one_of_two():
    same = diagnostics.sibling_hindsight(_scaled_world({"vLLM": 0.75}, ("A100", "H100 SXM", "H200 SXM")))
    assert same["from_other_gpus"]["mdape"] == pytest.approx(0.0, abs=1e-6)
    assert {g["from_other_gpus"]["alpha"]["vLLM"] for g in same["per_gpu"].values()} == {0.75}
    # the H200 follows its sibling, the H100, at the power 0.25: the other pairs teach it 0.75
    mixed = _scaled_world({"vLLM": 0.75}, ("A100", "H100 SXM", "H200 SXM"))
    h100, h200 = (np.flatnonzero(mixed.gpu == mixed.gpu[i]) for i in (3, 6))
    itl = mixed.itl_s.copy()
    itl[h200] = itl[h100] * (mixed.roofline_s[h200] / mixed.roofline_s[h100]) ** 0.25
    d = diagnostics.sibling_hindsight(build([measurements.Measurement(**{**m.__dict__, "itl_s": v})
                                             for m, v in zip(mixed.rows, itl)], *_specs()))
    got = d["per_gpu"][str(mixed.gpu[6])]
    assert got["hindsight"] == {"alpha": {"vLLM": 0.25}, "mdape": pytest.approx(0.0, abs=1e-6)}
    assert got["from_other_gpus"]["alpha"] == {"vLLM": 0.75} and got["from_other_gpus"]["mdape"] > 10
