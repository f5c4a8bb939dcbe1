"""Sibling transfer: an unmeasured GPU's ITL from its measured part of the same manufacturer."""
from __future__ import annotations

import dataclasses
import functools
import json
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from unbroken.predict import evaluate, models, service, siblings, tables
from unbroken.predict.dataset import build
from unbroken.predict.features import FEATURES, FRAMEWORKS, GPU_COLUMNS, ROOFLINE, SCENARIOS, OperatingPoint, matrix, \
    with_batch, with_gpu
from unbroken.predict.measurements import Measurement

RATIO = {a: siblings.Law("ratio", a) for a in (0.5, 0.75, 1.0)}

QUICK = models.XgbConfig(n_estimators=30, max_depth=3, learning_rate=0.3)


@pytest.fixture(autouse=True)
def _toy_parts_are_siblings(monkeypatch):
    """The toy worlds here measure a part 3-36 times per setup; the real threshold
    (SIBLING_MIN_ROWS) has its own test, which sets it back."""
    monkeypatch.setattr(siblings, "SIBLING_MIN_ROWS", 1)


@functools.cache
def _specs():
    return tables.load_gpus(), tables.load_models()


def _full_gpus() -> list[tables.GpuSpec]:
    return [g for g in _specs()[0].specs if g.memory_bandwidth_gb_s > 0 and g.tensor_tflops > 0]


LENGTH = st.one_of(st.just(math.nan), st.integers(16, 4096).map(float))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_row_moved_to_another_gpu_reads_as_built_on_it(data):
    gpus, mods = _specs()
    g, h = (data.draw(st.sampled_from(_full_gpus())) for _ in range(2))
    model = mods.get(data.draw(st.sampled_from(["meta-llama/Meta-Llama-3.1-8B", "mistralai/Mixtral-8x7B-Instruct-v0.1",
                                                 "meta-llama/Llama-2-70b-hf"])))
    op = OperatingPoint(n_gpus=data.draw(st.integers(1, 8)), batch=float(data.draw(st.integers(1, 256))),
                        prompt_tokens=data.draw(LENGTH), output_tokens=data.draw(LENGTH),
                        scenario=data.draw(st.sampled_from(SCENARIOS)), framework=data.draw(st.sampled_from(FRAMEWORKS)))
    on_h = matrix([(h, model, op)])
    moved = with_gpu(matrix([(g, model, op)]), on_h[0, list(GPU_COLUMNS)])
    np.testing.assert_allclose(moved, on_h, rtol=1e-9, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_row_moved_to_another_batch_reads_as_built_at_it(data):
    gpus, mods = _specs()
    g = data.draw(st.sampled_from(list(gpus.specs)))
    model = mods.get(data.draw(st.sampled_from(["meta-llama/Meta-Llama-3.1-8B", "mistralai/Mixtral-8x7B-Instruct-v0.1"])))
    b, b2 = (float(data.draw(st.integers(1, 1024))) for _ in range(2))
    op = OperatingPoint(n_gpus=data.draw(st.integers(1, 8)), batch=b, prompt_tokens=data.draw(LENGTH),
                        output_tokens=data.draw(LENGTH), scenario=data.draw(st.sampled_from(SCENARIOS)))
    at_b2 = matrix([(g, model, dataclasses.replace(op, batch=b2))])
    np.testing.assert_allclose(with_batch(matrix([(g, model, op)]), math.log2(b2)), at_b2, rtol=1e-9, equal_nan=True)


def test_a_siblings_itl_beyond_its_largest_batch_follows_its_line():
    """Trees flat beyond batch 64 (what they learnt at the edge); the truth, ITL = 2 ms + 0.1 ms x
    batch (weights once, each sequence on top), is recovered from the line through batch 32 and 64.
    A part that ran batch 256 is read as it is; a line steeper than proportional is held at
    proportional, one that falls is held flat."""
    gpus, mods = _specs()
    X = matrix([(gpus.get("MI250"), mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint(batch=float(b)))
                for b in (16, 64, 128, 256)])
    batch = np.exp2(X[:, FEATURES.index("log2_batch")])

    def trees(Xs: np.ndarray, host: float = 2e-3, per_seq: float = 1e-4) -> np.ndarray:
        return host + per_seq * np.minimum(np.exp2(Xs[:, FEATURES.index("log2_batch")]), 64.0)

    np.testing.assert_allclose(siblings.beyond_batches(trees, X, 6.0), 2e-3 + 1e-4 * batch, rtol=1e-9)
    np.testing.assert_allclose(siblings.beyond_batches(trees, X, 8.0), trees(X))  # it ran them all
    np.testing.assert_allclose(siblings.beyond_batches(trees, X, math.nan), trees(X))  # nothing known
    steep = siblings.beyond_batches(lambda Xs: trees(Xs, host=-2e-3), X, 6.0)  # 2.7x from 32 to 64
    np.testing.assert_allclose(steep, trees(X, host=-2e-3) * np.maximum(batch / 64, 1), rtol=1e-9)
    falling = siblings.beyond_batches(lambda Xs: trees(Xs, per_seq=-1e-5), X, 6.0)
    np.testing.assert_allclose(falling, trees(X, per_seq=-1e-5), rtol=1e-9)
    known = siblings.parts(X, siblings.Hardware(np.array(["a"] * 4), np.array(["AMD"] * 4)))
    assert known[0].largest_batch_of((float(FRAMEWORKS.index("vLLM")), float(SCENARIOS.index("server")))) == 8.0


def test_a_gpu_without_bandwidth_cannot_be_moved_to():
    gpus, mods = _specs()
    sn40l = gpus.get("SN40L")
    assert math.isnan(sn40l.memory_bandwidth_gb_s)
    X = matrix([(gpus.get("H100 SXM"), mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint())])
    assert np.isnan(with_gpu(X, matrix([(sn40l, mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint())])[0, list(GPU_COLUMNS)])).all()


def _rows(gpu: str, frameworks=("vLLM",)) -> list[tuple]:
    gpus, mods = _specs()
    return [(gpus.get(gpu), mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint(batch=float(b), framework=f))
            for b in (1, 8, 64) for f in frameworks]


def _known(*named: tuple[str, str, tuple[str, ...]]) -> tuple[siblings.Part, ...]:
    X, gpu, maker = [], [], []
    for name, mk, fws in named:
        rows = _rows(name, fws)
        X.append(matrix(rows))
        gpu += [rows[0][0].name] * len(rows)
        maker += [mk] * len(rows)
    return siblings.parts(np.vstack(X), siblings.Hardware(np.array(gpu), np.array(maker)))


def test_the_sibling_is_the_nearest_measured_part_of_the_maker_that_ran_the_setup():
    known = _known(("A100 SXM4 40GB", "NVIDIA", ("vLLM", "TensorRT-LLM")), ("H100 SXM", "NVIDIA", ("vLLM",)),
                   ("MI300X", "AMD", ("vLLM",)))
    h200 = matrix(_rows("H200 SXM"))[0]
    server = float(SCENARIOS.index("server"))  # the scenario _rows serve in

    def setup(framework: str, scenario: float = server) -> tuple[float, float]:
        return float(FRAMEWORKS.index(framework)), scenario

    figures, vllm = h200[list(GPU_COLUMNS)], setup("vLLM")
    assert siblings.sibling(known, "NVIDIA", figures, vllm).name == "NVIDIA H100 SXM5 80GB"  # nearer than the A100
    assert siblings.sibling(known, "NVIDIA", figures, setup("TensorRT-LLM")).name == "NVIDIA A100-SXM4-40GB"
    assert siblings.sibling(known, "NVIDIA", figures, setup("llama.cpp")) is None  # no part ran it
    offline = float(SCENARIOS.index("offline"))
    assert siblings.sibling(known, "NVIDIA", figures, setup("vLLM", offline)) is None  # vLLM, but not offline
    assert siblings.sibling(known, "Intel", figures, vllm) is None  # no measured part of that maker
    assert siblings.sibling(known, "", figures, vllm) is None
    h100 = matrix(_rows("H100 SXM"))[0][list(GPU_COLUMNS)]
    assert siblings.sibling(known, "NVIDIA", h100, vllm) is None  # measured itself: the trees know it


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_transfer_scales_the_siblings_itl_by_the_roofline_ratio(alpha):
    known = _known(("H100 SXM", "NVIDIA", ("vLLM",)))
    X = matrix(_rows("H200 SXM") + _rows("MI300X"))
    makers = np.array(["NVIDIA"] * 3 + ["AMD"] * 3)
    seen = []
    out, used, own = siblings.transfer(lambda Xs: seen.append(Xs) or np.full(len(Xs), 0.01), X, makers, known,
                                       lambda framework: siblings.Law("ratio", alpha))
    on_h100 = matrix(_rows("H100 SXM"))
    np.testing.assert_allclose(seen[0], on_h100)  # the trees asked about the H100
    np.testing.assert_allclose(out[:3], 0.01 * np.exp(alpha * (X[:3, ROOFLINE] - on_h100[:, ROOFLINE])))
    assert np.isnan(out[3:]).all() and used == ["NVIDIA H100 SXM5 80GB"] * 3 + [None] * 3 and own == [None] * 6
    if alpha == 1.0:  # the H200 reads 4.8 TB/s against 3.35: a bandwidth-bound row is that much faster
        assert out[0] == pytest.approx(0.01 * 3350 / 4800, rel=0.02)


def test_one_offset_serves_stacks_at_different_levels_where_one_ratio_does_not():
    """Two vendors' stacks at 2x and 10x the roofline, each with 2 ms of host time per token: the
    offset law with c = 1 carries both over (k, read off each sibling's rows, holds the level);
    one alpha is wrong for at least one of them."""
    gpus, mods = _specs()
    pairs = {"NVIDIA": ("H100 SXM", "A100 SXM4 40GB", 2.0), "AMD": ("MI300X", "MI250", 10.0)}
    models_ = ("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf")

    def rows(gpu: str) -> np.ndarray:
        return matrix([(gpus.get(gpu), mods.get(m), OperatingPoint(batch=float(b))) for m in models_ for b in (1, 16, 64)])

    def truth(X: np.ndarray, maker: str) -> np.ndarray:
        return pairs[maker][2] * np.exp(X[:, ROOFLINE]) + 0.002

    X_sib = {mk: rows(sib) for mk, (sib, _, _) in pairs.items()}
    known = siblings.parts(np.vstack(list(X_sib.values())),
                           siblings.Hardware(np.repeat([gpus.get(s).name for s, _, _ in pairs.values()], 9),
                                             np.repeat(list(pairs), 9)),
                           np.concatenate([truth(X, mk) for mk, X in X_sib.items()]))
    assert [p.efficiency[0][2] for p in known] == pytest.approx([10.0, 2.0], rel=0.3)  # MI300X, H100 (by name)
    X = np.vstack([rows(target) for _, target, _ in pairs.values()])
    makers, true = np.repeat(list(pairs), 9), np.concatenate([truth(rows(t), mk) for mk, (_, t, _) in pairs.items()])

    def err(law: siblings.Law) -> np.ndarray:  # the trees replaced by the truth on the sibling
        got = [siblings.transfer(lambda Xs, mk=mk: truth(Xs, mk), X[i * 9:(i + 1) * 9], makers[i * 9:(i + 1) * 9],
                                 known, lambda f: law).itl_s for i, mk in enumerate(pairs)]
        return np.abs(np.concatenate(got) / true - 1)

    assert np.median(err(siblings.Law("offset", 1.0))) < 0.05
    assert min(max(np.median(err(siblings.Law("ratio", a))[:9]), np.median(err(siblings.Law("ratio", a))[9:]))
               for a in np.arange(0, 1.3, 0.25)) > 0.05


@given(host=st.floats(0.0, 0.05), c=st.floats(0.5, 8.0), k=st.floats(1.0, 20.0), here=st.floats(1e-4, 0.02),
       there=st.floats(1e-4, 0.02))
def test_the_offset_law_carries_the_host_share_over_and_scales_the_rest(host, c, k, here, there):
    """A sibling whose stack takes k rooflines where bandwidth-bound and spends `host` seconds beyond
    c*k of its rooflines spends them on the GPU too."""
    law = siblings.Law("offset", c)
    got = law.apply(np.array([host + c * k * there]), np.log([here]), np.log([there]), k)[0]
    assert got == pytest.approx(max(host + c * k * here, here), rel=1e-9)
    assert got >= here * (1 - 1e-12)  # never below the GPU's own roofline
    assert np.isnan(law.apply(np.array([host + there]), np.log([here]), np.log([there]))[0])  # no efficiency known
    ratio = siblings.Law("ratio", 0.0).apply(np.array([host + c * there]), np.log([here]), np.log([there]))[0]
    assert ratio == pytest.approx(host + c * there)  # alpha 0 copies the sibling


@given(a=st.floats(0.0, 2.0), b=st.floats(0.0, 2.0), bw=st.floats(-2.0, 2.0), tf=st.floats(-2.0, 2.0),
       itl=st.floats(1e-4, 1.0))
def test_the_specs_law_scales_by_bandwidth_and_tflops_apart(a, b, bw, tf, itl):
    law = siblings.Law("specs", a, b)
    got = law.apply(np.array([itl]), np.log([0.01]), np.log([0.02]), math.nan, (bw, tf))[0]
    assert got == pytest.approx(itl * math.exp(bw) ** -a * math.exp(tf) ** -b, rel=1e-9)
    assert np.isnan(law.apply(np.array([itl]), np.log([0.01]), np.log([0.02]))[0])  # no speed-up known
    assert law.parameters == 2 and siblings.Law("ratio", a).parameters == 1


def test_one_specs_law_carries_a_memory_upgrade_and_a_new_generation():
    """The GH200 is an H100 with faster memory: in a world whose stacks gain from TFLOPS ** 0.5 and
    not from bandwidth, it copies the H100 while the H100 runs sqrt(TFLOPS ratio) faster than the A100.
    One specs law carries both pairs; no ratio alpha does (the roofline follows bandwidth in both)."""
    gpus, mods = _specs()
    h100, gh200, a100 = (gpus.get(n) for n in ("H100 SXM", "GH200", "A100 SXM4 40GB"))
    assert h100.tensor_tflops == gh200.tensor_tflops and gh200.memory_bandwidth_gb_s > h100.memory_bandwidth_gb_s
    model, op = mods.get("meta-llama/Meta-Llama-3.1-8B"), OperatingPoint(batch=16.0)
    X = {g.name: matrix([(g, model, op)])[0] for g in (h100, gh200, a100)}

    def itl(g) -> float:  # the world's truth: 20 ms on the A100, faster with TFLOPS alone
        return 0.02 * (a100.tensor_tflops / g.tensor_tflops) ** 0.5

    def err(law: siblings.Law, here, there) -> float:
        speedup = siblings.log_speedup(X[here.name][list(GPU_COLUMNS)], X[there.name][list(GPU_COLUMNS)])
        got = law.apply(np.array([itl(there)]), X[here.name][ROOFLINE], X[there.name][ROOFLINE], math.nan, speedup)
        return abs(float(got[0]) / itl(here) - 1)

    pairs = ((gh200, h100), (h100, a100))
    assert max(err(siblings.Law("specs", 0, 0.5), *p) for p in pairs) < 1e-9
    assert min(max(err(siblings.Law("ratio", a), *p) for p in pairs) for a in np.arange(0, 2.01, 0.05)) > 0.05


def test_a_two_exponent_law_needs_more_siblings_than_exponents(monkeypatch):
    def hw(*gpus_makers) -> siblings.Hardware:
        g, m = zip(*gpus_makers)
        return siblings.Hardware(np.repeat(g, 3), np.repeat(m, 3))

    two = hw(("A100", "NVIDIA"), ("V100", "NVIDIA"), ("Gaudi2", "Intel Habana"), ("x", ""))
    assert siblings.laws_for(two) == tuple(a for a in siblings.LAWS if a.kind != "specs")
    assert siblings.laws_for(hw(("A100", "NVIDIA"), ("V100", "NVIDIA"), ("H100", "NVIDIA"))) == siblings.LAWS
    assert siblings.laws_for(hw(("A100", "NVIDIA"), ("MI250", "AMD"), ("Max 1550", "Intel"))) == ()
    # a GPU with fewer rows than a sibling needs does not count (a few-shot split's held-out one)
    monkeypatch.setattr(siblings, "SIBLING_MIN_ROWS", 3)
    few = siblings.Hardware(np.array(["A100"] * 3 + ["V100"] * 3 + ["H100"] * 2), np.array(["NVIDIA"] * 8))
    assert siblings.laws_for(few) == siblings.laws_for(two)
    assert any(a.kind == "specs" for a in siblings.LAWS)


def test_a_frameworks_law_is_chosen_on_the_rows_a_law_moves():
    """Framework 0: three rows a sibling moves, two no law moves (the trees, 20% off). Law A is exact
    on two of the three moved rows, B 10% off on all three: over every row of the framework B's median
    wins (10% against A's 20%, set by the unmoved rows), over the moved rows A's (0 against 10%)."""
    A, B = RATIO[0.5], RATIO[1.0]
    framework, y = np.array([0.0] * 5 + [1.0] * 3), np.ones(8)
    trees = np.r_[np.full(3, 2.0), 1.2, 1.2, np.full(3, 2.0)]
    oofs = {(None, "trees"): trees,
            (A, "trees"): np.r_[1.0, 1.0, 1.5, 1.2, 1.2, np.full(3, 1.5)],
            (B, "trees"): np.r_[1.1, 1.1, 1.1, 1.2, 1.2, np.full(3, 1.0)]}
    oof, cfg = models.per_framework(oofs, y, framework, QUICK, "trees")
    assert (cfg.law_for(0.0), cfg.law_for(1.0)) == (A, B)
    np.testing.assert_allclose(oof, np.r_[1.0, 1.0, 1.5, 1.2, 1.2, np.full(3, 1.0)])


def test_a_frameworks_law_weighs_every_gpu_alike():
    """Framework 0: five rows of GPU a, one of GPU b. Law A is exact on a and 50% off on b, B 10% off on
    both: pooled, a's rows make A's median 0; per GPU, A averages 25% and B 10%. Framework 1: A exact."""
    A, B = RATIO[0.5], RATIO[1.0]
    framework, y, gpus = np.array([0.0] * 6 + [1.0] * 2), np.ones(8), np.array(list("aaaaab") + ["a", "b"])
    oofs = {(None, "trees"): np.full(8, 2.0),
            (A, "trees"): np.r_[np.full(5, 1.0), 1.5, 1.0, 1.0],
            (B, "trees"): np.r_[np.full(6, 1.1), 1.3, 1.3]}
    assert models.per_framework(oofs, y, framework, QUICK, "trees") is None  # pooled: A for both
    oof, cfg = models.per_framework(oofs, y, framework, QUICK, "trees", gpus)
    assert (cfg.law_for(0.0), cfg.law_for(1.0)) == (B, A)
    np.testing.assert_allclose(oof, np.r_[np.full(6, 1.1), 1.0, 1.0])


def test_a_part_with_a_few_rows_in_a_setup_is_nobodys_sibling_there(monkeypatch):
    """A GPU measured a few times (a few-shot split's held-out one, a user's) is a part, so its own rows
    are recognised, but the trees' ITL of it is no measurement to carry to another GPU."""
    monkeypatch.setattr(siblings, "SIBLING_MIN_ROWS", 30)
    gpus, mods = _specs()
    vllm, llama = (float(FRAMEWORKS.index(f)) for f in ("vLLM", "llama.cpp"))
    server = float(SCENARIOS.index("server"))

    def rows(gpu: str, n: int, framework: str) -> np.ndarray:
        return matrix([(gpus.get(gpu), mods.get("meta-llama/Meta-Llama-3.1-8B"),
                        OperatingPoint(batch=float(b + 1), framework=framework)) for b in range(n)])

    X = np.vstack([rows("MI250", 40, "vLLM"), rows("MI250", 3, "llama.cpp"), rows("MI300X", 5, "vLLM")])
    hw = siblings.Hardware(np.array(["MI250"] * 43 + ["MI300X"] * 5), np.array(["AMD"] * 48))
    mi250, mi300x = siblings.parts(X, hw)
    assert mi250.setups == {(vllm, server)} and mi300x.setups == frozenset()
    figures = X[-1, list(GPU_COLUMNS)]
    assert siblings.own_part((mi250, mi300x), "AMD", figures) is mi300x  # its own rows: still known
    assert siblings.sibling((mi250, mi300x), "AMD", figures, (vllm, server), measured_ok=True) is mi250
    assert siblings.sibling((mi250, mi300x), "AMD", X[0, list(GPU_COLUMNS)], (vllm, server), measured_ok=True) is None
    assert siblings.sibling((mi250,), "AMD", figures, (llama, server)) is None  # 3 llama.cpp rows: not enough


def _stack_world(odd: float = 1.0, powers: dict[str, float] | None = None) -> "evaluate.Table":
    """Four GPUs, two makers whose software runs at 10x and 1x the roofline, their datasheets
    interleaved so that no spec tells the makers apart: LOGO's trees mix the levels, a sibling does not.
    The MI300X runs at `odd` times its maker's level. `powers`: serving framework -> the power of the
    roofline its ITL follows (default: vLLM's, 1)."""
    gpus, mods = _specs()
    parts = [("A100 SXM4 40GB", "slow"), ("MI250", "fast"), ("H100 SXM", "slow"), ("MI300X", "fast")]
    specs, rows = [], []
    for name, maker in parts:
        spec = dataclasses.replace(gpus.get(name), manufacturer=maker)
        specs.append(spec)
        for model in ("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf"):
            for b, (framework, power_of) in itertools.product((1, 4, 16, 64), (powers or {"vLLM": 1.0}).items()):
                X = matrix([(spec, mods.get(model), OperatingPoint(batch=float(b), framework=framework))])
                level = (10.0 if maker == "slow" else 1.0) * (odd if name == "MI300X" else 1.0)
                itl = level * math.exp(X[0, ROOFLINE] * power_of) * 0.01 ** (1 - power_of)
                power = spec.thermal_design_power_w * (0.4 + 0.005 * b)
                rows.append(Measurement("toy", spec.name, model, 1, float(b), math.nan, math.nan, "server", framework,
                                        power, itl))
    table = tables.GpuTable(specs=tuple(specs), aliases={tables.key(s.name): s.name for s in specs}, files=("toy",))
    return build(rows, table, mods)


def test_logo_takes_an_unseen_gpus_level_from_its_sibling():
    world = _stack_world()
    assert sorted(set(world.maker.tolist())) == ["fast", "slow"]
    plain = evaluate.predict_held_out(world, "itl", "logo", grid=(QUICK,), transfer=False)
    moved = evaluate.predict_held_out(world, "itl", "logo", grid=(QUICK,))
    err = {name: models.mdape(p["xgboost"], world.itl_s) for name, p in (("plain", plain), ("moved", moved))}
    assert err["plain"] > 50 and err["moved"] < 10, err
    assert all(c.sibling_law is not None for c in moved["configs"])
    assert all(c.sibling_law is None for c in plain["configs"]) and set(plain["sibling"]) == {""}
    h100 = world.gpu == "NVIDIA H100 SXM5 80GB"
    assert set(moved["sibling"][h100]) == {"NVIDIA A100-SXM4-40GB"}  # its maker's only other part


def test_cv_never_transfers():
    world = _stack_world()
    preds = evaluate.predict_held_out(world, "itl", "cv", grid=(QUICK,))
    assert all(c.sibling_law is None for c in preds["configs"]) and set(preds["sibling"]) == {""}


def test_the_service_names_the_sibling_and_its_cache_keeps_it(tmp_path):
    world = _stack_world()
    mi300x = world.gpu == "AMD Instinct MI300X"
    train = world.subset(np.flatnonzero(~mi300x))
    trained = service.train_cached(train, config=QUICK, k=3, root=tmp_path)
    again = service.train_cached(train, config=QUICK, k=3, root=tmp_path)  # from the cache
    gpus, mods = _specs()
    spec = dataclasses.replace(gpus.get("MI300X"), manufacturer="fast")
    model, op = mods.get("meta-llama/Llama-2-13b-hf"), OperatingPoint(batch=16.0)
    a, b = (service.estimate(t, spec, model, op) for t in (trained, again))
    assert trained.itl.config.sibling_law is not None and again.itl.config == trained.itl.config
    as_saved = [service._part_to_json(p) for p in trained.itl.parts]  # NaN figures: compare as saved (None)
    assert [service._part_to_json(p) for p in again.itl.parts] == as_saved and len(as_saved) == 3
    assert a.itl_sibling == b.itl_sibling == "AMD Instinct MI250" and a.itl_s == pytest.approx(b.itl_s)
    truth = world.itl_s[mi300x & (world.model == "meta-llama/Llama-2-13b-hf") & (world.X[:, FEATURES.index("log2_batch")] == 4)]
    assert a.itl_s[0] == pytest.approx(truth[0], rel=0.15)
    assert service.as_dict(a)["itl_sibling"] == "AMD Instinct MI250"


def test_a_cache_trained_with_other_laws_is_not_reused(monkeypatch):
    world = _stack_world()
    key = service._key(world, 0.9, QUICK, 3)
    assert all(str(a) in service.RECIPE for a in siblings.LAWS)
    monkeypatch.setattr(service, "RECIPE", service.RECIPE.replace(str(siblings.LAWS[0]), "ratio 0.1"))
    assert service._key(world, 0.9, QUICK, 3) != key


def test_seen_modes_need_a_transfer_law():
    with pytest.raises(ValueError, match="seen_mode"):
        models.XgbConfig(seen_mode="sibling_level")
    with pytest.raises(ValueError, match="seen_mode"):
        models.XgbConfig(sibling_law=RATIO[1.0], seen_mode="guess")
    assert models.XgbConfig(sibling_law=RATIO[1.0], seen_mode="sibling").seen_mode == "sibling"


def test_a_measured_gpu_is_predicted_by_its_mode():
    world = _stack_world(odd=2.0)  # the MI300X runs at twice its sibling's (the MI250's) level
    hw = siblings.Hardware(world.gpu, world.maker)
    cfg = dataclasses.replace(QUICK, sibling_law=RATIO[1.0])
    model = models.fit_xgb(world.X, np.log(world.itl_s), cfg, models.balanced_weights(world.gpu))
    known = siblings.parts(world.X, hw)
    levels = models.own_levels(model, world.X, world.itl_s, "itl", cfg, hw, known)
    vllm = float(FRAMEWORKS.index("vLLM"))
    assert set(levels) == {(g, vllm) for g in set(world.gpu.tolist())}  # per GPU and framework it ran
    assert levels[("AMD Instinct MI300X", vllm)] == pytest.approx(2.0, rel=0.15)
    assert levels[("AMD Instinct MI250", vllm)] == pytest.approx(0.5, rel=0.15)
    mi300x = world.gpu == "AMD Instinct MI300X"
    X, makers, truth = world.X[mi300x], world.maker[mi300x], world.itl_s[mi300x]
    out = {m: models.point(model, X, "itl", cfg, makers, known, levels=levels, seen_mode=m)
           for m in models.SEEN_MODES}
    assert out["trees"][1] == [None] * len(X)  # measured: the trees know it
    assert set(out["sibling"][1]) == set(out["sibling_level"][1]) == {"AMD Instinct MI250"}
    np.testing.assert_allclose(out["sibling_level"][0], levels[("AMD Instinct MI300X", vllm)] * out["sibling"][0])
    assert models.mdape(out["sibling_level"][0], truth) < 15 < models.mdape(out["sibling"][0], truth)
    other = {k: v for k, v in levels.items() if k[0] != "AMD Instinct MI300X"}
    alone = models.point(model, X, "itl", cfg, makers, known, levels=other, seen_mode="sibling_level")
    np.testing.assert_allclose(alone[0], out["sibling"][0])  # no level for it: its sibling's
    llama = {("AMD Instinct MI300X", float(FRAMEWORKS.index("llama.cpp"))): 5.0}
    other_stack = models.point(model, X, "itl", cfg, makers, known, levels=llama, seen_mode="sibling_level")
    np.testing.assert_allclose(other_stack[0], out["sibling"][0])  # llama.cpp's level says nothing of vLLM


def test_few_shot_logo_reads_an_odd_gpus_level_off_its_shots():
    world = _stack_world(odd=3.0)
    grid = (QUICK,)
    preds = evaluate.predict_held_out(world, "itl", "logo", grid=grid, shots=3)
    mi300x = world.gpu == "AMD Instinct MI300X"
    fold = [c for c, held in zip(preds["configs"], sorted(set(world.gpu.tolist()))) if held == "AMD Instinct MI300X"]
    assert fold[0].seen_mode == "sibling_level"
    assert models.mdape(preds["xgboost"][mi300x], world.itl_s[mi300x]) < 15


def test_the_service_picks_a_seen_mode_per_row_count():
    world = _stack_world(odd=3.0)
    trained = service.train(world, config=QUICK, k=3)
    levels = trained.itl.measured["levels"]
    assert set(levels) == set(models.SHOT_LEVELS) and all(v["seen_mode"] in models.SEEN_MODES for v in levels.values())
    for n in models.SHOT_LEVELS:
        assert trained.itl.seen_mode(n) == levels[n]["seen_mode"]
    assert trained.itl.seen_mode(0) == trained.itl.config.seen_mode == "trees"  # fitted without shots


def test_the_record_names_the_siblings_used():
    from rich.console import Console

    from unbroken.bench import predict as bp

    world, quiet = _stack_world(), Console(quiet=True)
    logo = bp._run_one(world, "itl", (QUICK,), quiet)["logo"]
    assert logo["siblings_used"]["NVIDIA H100 SXM5 80GB"] == {"NVIDIA A100-SXM4-40GB": 12}
    assert all(c["sibling_law"] is not None for c in logo["configs_chosen"])
    assert logo["by_source"]["sibling"]["rows"] == len(world) and logo["by_source"]["trees"]["rows"] == 0
    few = bp._few_shot(world, "itl", (QUICK,), (2,), True, quiet)["2"]
    assert len(few["configs_chosen"]) == 4 and {c["seen_mode"] for c in few["configs_chosen"]} <= set(models.SEEN_MODES)
    assert sum(sum(v.values()) for v in few["siblings_used"].values()) == len(world)
    plain = bp._run_one(world, "itl", (QUICK,), quiet, transfer=False)["logo"]
    assert all(v == {"": 12} for v in plain["siblings_used"].values()) and "by_source" not in plain


def test_each_framework_may_take_its_own_alpha(monkeypatch):
    # vLLM's ITL follows the roofline, llama.cpp's its square root: one alpha fits neither stack (the
    # offset laws, which fit both closely in this world, are left out)
    monkeypatch.setattr(siblings, "LAWS", tuple(a for a in siblings.LAWS if a.kind == "ratio"))
    world = _stack_world(powers={"vLLM": 1.0, "llama.cpp": 0.5})
    one = evaluate.predict_held_out(world, "itl", "logo", grid=(QUICK,), framework_laws=False)
    each = evaluate.predict_held_out(world, "itl", "logo", grid=(QUICK,))
    err = {name: models.mdape(p["xgboost"], world.itl_s) for name, p in (("one", one), ("each", each))}
    assert err["each"] < 5 < err["one"], err
    vllm, llama = (float(FRAMEWORKS.index(f)) for f in ("vLLM", "llama.cpp"))
    assert all(c.law_for(vllm) == RATIO[1.0] and c.law_for(llama) == RATIO[0.5] for c in each["configs"]), \
        each["configs"]
    assert all(not c.framework_laws for c in one["configs"])


def test_per_framework_keeps_one_law_when_one_is_best():
    H, O = RATIO[0.5], RATIO[1.0]
    y = np.ones(6)
    framework = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    oofs = {(None, "trees"): np.full(6, 2.0), (H, "trees"): np.full(6, 1.01), (O, "trees"): np.full(6, 1.5)}
    assert models.per_framework(oofs, y, framework, QUICK, "trees") is None  # 0.5 for both: the plain candidate
    oofs[(O, "trees")] = np.r_[np.full(3, 1.5), np.full(3, 1.0)]
    oof, cfg = models.per_framework(oofs, y, framework, QUICK, "trees")
    np.testing.assert_allclose(oof, np.r_[np.full(3, 1.01), np.full(3, 1.0)])
    assert (cfg.law_for(0.0), cfg.law_for(1.0), cfg.law_for(7.0)) == (H, O, H)  # ties: the law offered first
    # the trees best for framework 0, whose rows a sibling moves: it still gets a law (the inner
    # folds' trees say little of a part whose vendor's level is far from its spec neighbours)
    oofs[(None, "trees")] = np.r_[np.full(3, 1.0), np.full(3, 2.0)]
    oof, cfg = models.per_framework(oofs, y, framework, QUICK, "trees")
    assert (cfg.law_for(0.0), cfg.law_for(1.0)) == (H, O)
    np.testing.assert_allclose(oof, np.r_[np.full(3, 1.01), np.full(3, 1.0)])
    # framework 2's rows no law moves (no sibling ran it): the trees predict them, and the config
    # names no law of its own for it (should a sibling run it at the refit, the remaining one)
    framework = np.r_[framework, 2.0, 2.0, 2.0, 2.0]
    y = np.ones(10)
    oofs = {(None, "trees"): np.r_[np.full(6, 2.0), np.full(4, 1.2)],
            (H, "trees"): np.r_[np.full(6, 1.01), np.full(4, 1.2)],
            (O, "trees"): np.r_[np.full(3, 1.5), np.full(3, 1.0), np.full(4, 1.2)]}
    oof, cfg = models.per_framework(oofs, y, framework, QUICK, "trees")
    np.testing.assert_allclose(oof, np.r_[np.full(3, 1.01), np.full(3, 1.0), np.full(4, 1.2)])
    assert cfg.framework_laws == ((1.0, O),) and cfg.sibling_law == cfg.law_for(2.0) == H
    # one law for every framework a sibling ran, whatever the others: the plain candidate
    oofs[(O, "trees")] = np.r_[np.full(6, 1.5), np.full(4, 1.2)]
    assert models.per_framework(oofs, y, framework, QUICK, "trees") is None


def test_framework_laws_survive_a_json_round_trip_and_are_checked():
    offset = siblings.Law("offset", 2)
    cfg = models.XgbConfig(sibling_law=RATIO[0.75], framework_laws=((3.0, None), (1.0, offset)), seen_mode="sibling")
    again = models.XgbConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and hash(again) == hash(cfg) and again.framework_laws == ((1.0, offset), (3.0, None))
    assert (cfg.law_for(1.0), cfg.law_for(3.0), cfg.law_for(2.0)) == (offset, None, RATIO[0.75])
    specs = siblings.Law("specs", 0.5, 0.25)
    assert models.XgbConfig(**json.loads(json.dumps(dataclasses.asdict(
        models.XgbConfig(sibling_law=specs))))).sibling_law == specs and str(specs) == "specs 0.5/0.25"
    assert siblings.Law.of({"kind": "ratio", "value": 0.5}) == RATIO[0.5]  # records before the specs law
    for bad in (3.0, {"kind": "ratio", "value": 3.0}, {"kind": "offset", "value": 9}, {"kind": "guess", "value": 1},
                {"kind": "ratio", "value": 0.5, "compute": 0.5}, {"kind": "specs", "value": 0.5, "compute": 3},
                {"kind": "specs", "value": 0.5, "tflops": 1}):
        with pytest.raises(ValueError, match="transfer law"):
            models.XgbConfig(framework_laws=((1.0, bad),))
    assert models.XgbConfig(framework_laws=((1.0, RATIO[0.5]),), seen_mode="sibling").transfers  # one is enough
    with pytest.raises(ValueError, match="seen_mode"):
        models.XgbConfig(framework_laws=((1.0, None),), seen_mode="sibling")


def test_by_source_scores_the_transferred_and_the_trees_rows_apart():
    preds = {"xgboost": np.array([1.0, 1.0, 1.0, np.nan]), "low": np.array([0.5, 0.5, 0.5, np.nan]),
             "high": np.array([2.0, 2.0, 2.0, np.nan]), "sibling": np.array(["A", "", "", ""], dtype=object)}
    out = evaluate.by_source(preds, np.array([1.5, 3.0, 1.0, 1.0]))  # the last row: a few-shot split's shot
    assert out["sibling"] == {"rows": 1, "mdape": pytest.approx(33.333), "coverage": 1.0,
                              "interval_median_width_pct": 150.0}
    assert out["trees"]["rows"] == 2 and out["trees"]["coverage"] == 0.5
    assert out["trees"]["mdape"] == pytest.approx(33.333)
