"""unbroken predict's learning parts: conformal intervals, splits, metrics, baselines, predictions (few trees)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from unbroken.predict import baselines, evaluate, measurements, models, service, tables
from unbroken.predict.dataset import build
from unbroken.predict.features import FEATURES, SCENARIOS, OperatingPoint

FAST = models.XgbConfig(n_estimators=20, max_depth=3, learning_rate=0.3)


@pytest.fixture(scope="module")
def specs():
    return tables.load_gpus(), tables.load_models()


@pytest.fixture(scope="module")
def v2(specs):
    return build(measurements.load("ml-energy"), *specs)


@given(st.lists(st.floats(0.01, 10), min_size=5, max_size=60))
def test_conformal_halfwidth_covers_the_calibration_rows(ratios):
    true = np.ones(len(ratios))
    q = models.conformal_halfwidth(np.array(ratios), true, 0.9)
    inside = np.abs(np.log(ratios)) <= q + 1e-12
    assert inside.mean() >= 0.9 or inside.all()


def test_mdape_median_of_percent_errors():
    assert models.mdape(np.array([110.0, 90.0, 100.0, np.nan]), np.array([100.0, 100.0, 100.0, 5.0])) == pytest.approx(10.0)


def test_logo_with_one_gpu_is_a_clear_error(v2):
    one = v2.subset(np.flatnonzero(v2.gpu == "NVIDIA A100-SXM4-40GB"))
    with pytest.raises(evaluate.SplitError, match="LOGO needs at least 2 GPUs"):
        evaluate.splits(one, "logo")


def test_logo_and_lolo_hold_out_exactly_one_group(v2):
    for kind, labels in (("logo", v2.gpu), ("lolo", v2.model)):
        folds = evaluate.splits(v2, kind)
        assert len(folds) == len(set(labels.tolist()))
        for tr, te in folds:
            assert len(set(labels[te].tolist())) == 1 and labels[te][0] not in set(labels[tr].tolist())
            assert len(tr) + len(te) == len(v2)


def test_kendall_is_one_for_perfect_and_minus_one_for_reversed(v2):
    t = v2.itl_s
    assert evaluate.kendall(v2, t, t, "model") == pytest.approx(1.0)
    assert evaluate.kendall(v2, t, -t, "model") == pytest.approx(-1.0)


def test_baselines_learn_only_from_training_rows(v2):
    tr, te = v2.subset(np.arange(0, 200)), v2.subset(np.arange(200, len(v2)))
    frac = np.mean(tr.power_w / tr.tdp_w)
    np.testing.assert_allclose(baselines.tdp_power(tr, te), te.tdp_w * frac)
    c = np.median(tr.itl_s / tr.roofline_s)
    np.testing.assert_allclose(baselines.roofline_itl(tr, te), c * te.roofline_s)


def test_roofline_is_exact_on_a_roofline_world(v2):
    fake = build([measurements.Measurement(**{**m.__dict__, "itl_s": 3.0 * r})
                  for m, r in zip(v2.rows, v2.roofline_s)], *_specs_of())
    pred = baselines.roofline_itl(fake, fake)
    np.testing.assert_allclose(pred, fake.itl_s, rtol=1e-9)


def _specs_of():
    return tables.load_gpus(), tables.load_models()


def test_fit_rejects_an_empty_training_split():
    with pytest.raises(ValueError, match="training split is empty"):
        models.fit(np.zeros((1, 3)), np.ones(1), "itl")


def test_xgboost_beats_the_roofline_in_cv_on_a_slice(v2):
    t = v2.with_target("itl")
    preds = evaluate.predict_held_out(t, "itl", "cv", grid=(FAST,))
    res = evaluate.score(t, "itl", preds)
    assert res["mdape"]["xgboost"] < res["mdape"]["baseline"]
    assert 0.5 < res["coverage"] <= 1.0
    assert (preds["low"] <= preds["xgboost"]).all() and (preds["xgboost"] <= preds["high"]).all()


def test_estimate_is_consistent(v2, specs):
    gpus, mods = specs
    trained = service.train(v2, config=FAST, k=3)
    op = OperatingPoint(n_gpus=1, batch=32)
    e = service.estimate(trained, gpus.get("H100 SXM"), mods.get("meta-llama/Meta-Llama-3.1-8B"), op, usd_per_gpu_hour=2.0)
    for v in (e.power_w, e.itl_s, e.tokens_s, e.tokens_per_j, e.usd_per_mtok):
        assert v[1] <= v[0] <= v[2] and all(math.isfinite(x) and x > 0 for x in v)
    assert e.tokens_s[0] == pytest.approx(32 / e.itl_s[0])
    assert e.tokens_per_j[0] == pytest.approx(e.tokens_s[0] / e.power_w[0])
    assert e.usd_per_mtok[0] == pytest.approx(2.0 / 3600 / e.tokens_s[0] * 1e6)
    ranked = service.rank(trained, gpus, mods.get("meta-llama/Meta-Llama-3.1-8B"), op)
    assert [r.tokens_per_j[0] for r in ranked] == sorted((r.tokens_per_j[0] for r in ranked), reverse=True)
    big = service.rank(trained, gpus, mods.get("meta-llama/Meta-Llama-3.1-405B-Instruct"), op)
    assert big == []  # 810 GB of weights fit on no single GPU


def test_cached_training_round_trips(v2, tmp_path):
    small = v2.subset(np.arange(0, 120))
    a = service.train_cached(small, config=FAST, k=3, root=tmp_path)
    b = service.train_cached(small, config=FAST, k=3, root=tmp_path)  # loaded, not retrained
    (folder,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["itl.json", "itl.ubj", "power.json", "power.ubj"]
    for x, y in ((a.power, b.power), (a.itl, b.itl)):
        np.testing.assert_allclose(x.predict(small.X)[0], y.predict(small.X)[0], rtol=1e-6)
        assert x.halfwidth == y.halfwidth and x.by_category == y.by_category
        assert x.measured == y.measured and x.measured["rows"]


def test_per_group_pearson():
    labels = np.array(["a", "a", "a", "b", "b", "c"])
    true = np.array([1.0, 2.0, 3.0, 1.0, 2.0, 5.0])
    pred = np.array([2.0, 4.0, 6.0, 2.0, 1.0, 5.0])
    r = evaluate.per_group_pearson(labels, pred, true)
    assert r["a"] == pytest.approx(1.0) and r["b"] == pytest.approx(-1.0) and math.isnan(r["c"])


@given(st.lists(st.integers(0, 20), min_size=1, max_size=200), st.sampled_from(evaluate.SPLITS), st.integers(2, 10))
def test_inner_k_is_leave_one_gpu_out_under_logo_only(labels, kind, default):
    groups = np.array([f"g{i}" for i in labels])
    n_groups = len(set(labels))
    k = evaluate.inner_k(kind, groups, default)
    if kind == "logo" and n_groups >= 2:
        assert k == min(n_groups, evaluate.MAX_INNER_LOGO)
        folds = models.inner_folds(len(groups), groups, k)
        held = [set(groups[te].tolist()) for _, te in folds]
        assert all(h.isdisjoint(set(groups[tr].tolist())) for h, (tr, _) in zip(held, folds))
        if n_groups <= evaluate.MAX_INNER_LOGO:
            assert all(len(h) == 1 for h in held)  # one training GPU per inner fold
    else:
        assert k == default  # CV, LOLO, or a single training GPU (row folds): unchanged
    assert evaluate.inner_k(kind, None, default) == default


def test_inner_k_rejects_bad_input():
    with pytest.raises(evaluate.SplitError, match="not one of"):
        evaluate.inner_k("loo", None)
    with pytest.raises(ValueError, match=">= 2"):
        evaluate.inner_k("cv", None, 1)


def test_held_out_records_the_inner_folds(v2):
    t = v2.with_target("itl")
    preds = evaluate.predict_held_out(t, "itl", "logo", grid=(FAST,))
    assert preds["inner_folds"] == [3, 3]  # one training GPU per outer split: row folds, as before


@given(st.lists(st.sampled_from("abcde"), min_size=1, max_size=80))
def test_balanced_weights_give_every_gpu_the_same_total_weight(labels):
    labels = np.array(labels)
    w = models.balanced_weights(labels)
    totals = [w[labels == u].sum() for u in set(labels.tolist())]
    assert w.mean() == pytest.approx(1.0) and max(totals) == pytest.approx(min(totals))


def test_balanced_fit_lets_a_sparsely_measured_gpu_move_the_trees():
    # GPU "a": 95 rows at target 1, GPU "b": 5 rows at target 3, features that cannot tell them
    # apart: unweighted the trees predict about the rows' mean (1.1), balanced the GPUs' mean (2)
    X, y = np.zeros((100, len(FEATURES))), np.r_[np.full(95, 1.0), np.full(5, 3.0)]
    gpus = np.array(["a"] * 95 + ["b"] * 5)
    cfg = models.XgbConfig(n_estimators=50, max_depth=1, learning_rate=0.5, subsample=1.0, colsample_bytree=1.0)
    plain = models.fit(X, y, "power", grid=(cfg,), k=2).predict(X[:1])[0][0]
    balanced = models.fit(X, y, "power", grid=(cfg,), k=2, balance=gpus).predict(X[:1])[0][0]
    assert plain == pytest.approx(1.1, abs=0.02) and balanced == pytest.approx(2.0, abs=0.02)


@given(st.integers(0, 20), st.integers(0, 3))
def test_shots_move_rows_of_the_held_out_gpu_into_training(shots, seed):
    t = build(measurements.load("ml-energy"), *(tables.load_gpus(), tables.load_models()))
    for tr, te in evaluate.splits(t, "logo", shots=shots, seed=seed):
        held = set(t.gpu[te].tolist())
        assert len(held) == 1 and not set(tr.tolist()) & set(te.tolist())
        assert int((t.gpu[tr] == next(iter(held))).sum()) == shots and len(tr) + len(te) == len(t)


def test_too_many_shots_is_a_clear_error(v2):
    with pytest.raises(evaluate.SplitError, match="use fewer shots"):
        evaluate.splits(v2, "logo", shots=len(v2))


def test_few_shot_scores_only_the_rows_it_predicted(v2):
    t = v2.with_target("itl")
    preds = evaluate.predict_held_out(t, "itl", "logo", grid=(FAST,), shots=5)
    assert int(np.isnan(preds["xgboost"]).sum()) == 10  # 5 shots of each of the 2 GPUs
    res = evaluate.score(t, "itl", preds)
    assert 0.5 < res["coverage"] <= 1 and math.isfinite(res["interval_median_width_pct"])
    # the by-hand baseline: each held-out GPU's roofline factor from its own 5 rows, only on the rows predicted
    assert (np.isfinite(preds["baseline_from_shots"]) == np.isfinite(preds["xgboost"])).all()
    with pytest.raises(evaluate.SplitError, match="not to cv"):
        evaluate.splits(t, "cv", shots=1)


def test_the_baseline_from_shots_is_the_held_out_gpus_own_factor(v2):
    t = v2.with_target("itl")
    preds = evaluate.predict_held_out(t, "itl", "logo", grid=(FAST,), shots=3)
    for tr, te in evaluate.splits(t, "logo", shots=3):
        own = tr[t.gpu[tr] == t.gpu[te][0]]
        expected = baselines.roofline_itl(t.subset(own), t.subset(te))
        np.testing.assert_allclose(preds["baseline_from_shots"][te], expected)


@given(st.lists(st.sampled_from("abcd"), min_size=4, max_size=60), st.integers(0, 6), st.integers(2, 4))
def test_few_shot_inner_folds_keep_shots_of_each_held_out_group(labels, shots, k):
    groups = np.array(labels)
    for tr, te in models.inner_folds(len(groups), groups, k, shots=shots):
        assert not set(tr.tolist()) & set(te.tolist()) and len(tr) + len(te) == len(groups)
        if len(set(groups.tolist())) < 2:
            continue  # row folds: shots do not apply
        for g in set(groups[te].tolist()):
            n = int((groups == g).sum())
            assert int((groups[tr] == g).sum()) == min(shots, n - 1) and (groups[te] == g).any()


def test_conformal_halfwidth_ignores_rows_no_fold_predicted():
    pred = np.array([1.0, 2.0, np.nan, np.nan])
    assert models.conformal_halfwidth(pred, np.ones(4), 0.5) == pytest.approx(math.log(2.0))


def test_a_gpu_measured_in_training_gets_the_few_shot_interval_of_its_row_count(specs, v2):
    gpus, mods = specs
    t = v2.with_target("itl")
    p = models.fit(t.X, t.itl_s, "itl", groups=t.gpu, grid=(FAST,), k=2, categories=t.category(), balance=t.gpu)
    m = models.measured_widths(p, t.X, t.itl_s, t.gpu, 2, t.category(), t.gpu)
    h100 = "NVIDIA H100 SXM5 80GB"
    assert m.rows_of(h100) == int((t.gpu == h100).sum()) and m.rows_of("NVIDIA H200 SXM") == 0
    assert p.measured is None and p.rows_of(h100) == 0 and sorted(m.measured["levels"]) == list(models.SHOT_LEVELS)
    x, cat = t.X[:3], t.category()[:3]
    for rows, level in ((0, None), (1, 1), (4, 1), (5, 5), (19, 5), (20, 20), (99, 20), (100, 100), (10_000, 100)):
        expected = m.widths(cat) if level is None else \
            np.array([m.measured["levels"][level]["by_category"].get(float(c), m.measured["levels"][level]["halfwidth"])
                      for c in cat])
        _, lo, hi = m.predict(x, cat, rows=rows)
        np.testing.assert_allclose(np.log(hi / lo) / 2, expected)
    assert not np.allclose(m.widths(cat, rows=20), m.widths(cat))  # a width of its own, not the unseen GPU's
    trained = service.Trained(power=m, itl=m, n_power_rows=0, n_itl_rows=len(t))
    e = service.estimate(trained, gpus.get("H100 SXM"), mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint())
    assert e.gpu_rows == m.rows_of(h100)
    assert math.log(e.itl_s[2] / e.itl_s[1]) / 2 == pytest.approx(float(np.atleast_1d(
        m.widths(np.array([features_scenario("server")]), rows=e.gpu_rows))[0]))


def features_scenario(name: str) -> float:
    """The scenario's code as the feature matrix holds it."""
    return float(SCENARIOS.index(name))


def test_an_estimate_says_whether_its_gpu_was_measured(specs, v2):
    gpus, mods = specs
    trained = service.train(v2, config=FAST, k=3)
    model, op = mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint(batch=8)
    seen, unseen = (service.estimate(trained, gpus.get(g), model, op) for g in ("H100 SXM", "H200 SXM"))
    assert seen.gpu_rows == int((v2.gpu == "NVIDIA H100 SXM5 80GB").sum()) and unseen.gpu_rows == 0
    assert service.as_dict(seen)["gpu_rows"] == seen.gpu_rows


def test_a_gpu_measured_under_an_alias_is_one_group_with_its_table_name(specs):
    gpus, mods = specs
    h100 = [m for m in measurements.load("ml-energy") if m.gpu == "NVIDIA H100 SXM5 80GB"][:4]
    aliased = h100[:2] + [dataclasses.replace(m, gpu="H100 SXM") for m in h100[2:]]  # as a user may name it
    assert build(aliased, gpus, mods).gpu.tolist() == ["NVIDIA H100 SXM5 80GB"] * 4
