"""unbroken predict's data pipeline: the power formula on known rows, spec lookup and unit checks, features."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from unbroken.predict import features, measurements, tables
from unbroken.predict.dataset import build
from unbroken.predict.features import OperatingPoint


@pytest.fixture(scope="module")
def gpus():
    return tables.load_gpus()


@pytest.fixture(scope="module")
def models():
    return tables.load_models()


def test_power_formula_on_known_rows():
    # ML.ENERGY v2, gemma-2-27b-it on 4 A100s (bs128+tp4+pp1.json): 230.644 J/request over 392.471
    # output tokens at 1051.34 tok/s is 617.84 W for the four GPUs, 154.46 W each
    v2 = measurements.load_ml_energy_v2()
    row = next(m for m in v2 if m.source == "chat/A100-SXM4-40GB/google/gemma-2-27b-it/bs128+tp4+pp1.json")
    assert row.n_gpus == 4 and row.power_w == pytest.approx(154.460, abs=1e-3)
    # 2023 set, koala-13b on A100 (chat): energy 2144.83 J, 265.573 tokens, 21.2077 tok/s -> 171.28 W
    legacy = measurements.load_ml_energy_legacy()
    row = next(m for m in legacy if m.source.startswith("A100_chat_benchmark.csv") and m.model == "BAIR/koala-13b")
    assert row.power_w == pytest.approx(171.279, abs=1e-3)
    # and that is energy over latency within the 2023 set's own rounding of tokens vs time
    assert row.power_w == pytest.approx(2144.8338435191445 / 12.1433556952537, rel=0.05)


@given(e=st.floats(1, 1e5), tok=st.floats(1, 1e4), tput=st.floats(0.1, 1e5), n=st.integers(1, 16))
def test_power_formula_inverts_to_energy(e, tok, tput, n):
    p = measurements.power_from_energy(e, tok, tput, n)
    assert p * n * tok / tput == pytest.approx(e, rel=1e-9)


def test_datasets_join_the_spec_tables(gpus, models):
    for name in measurements.DATASETS:
        t = build(measurements.load(name), gpus, models)
        assert len(t) > 200 and t.X.shape == (len(t), len(features.FEATURES))
        assert (t.itl_s > 0).all() and (t.itl_s < 10).all()  # seconds per token, not ms
    power = build(measurements.load("ml-energy"), gpus, models).target("power")
    assert 0.05 < power.min() and power.max() < 1.2  # per-GPU power over TDP


@pytest.mark.parametrize("label,name", [("H100 SXM", "NVIDIA H100 SXM5 80GB"), ("Nvidia H100 GPU", "NVIDIA H100 SXM5 80GB"),
                                        ("A100", "NVIDIA A100-SXM4-40GB"), ("Intel PVC GPU", "Intel Data Center GPU Max 1550"),
                                        ("a40", "NVIDIA A40"), ("H200 NVL", "NVIDIA H200")])
def test_gpu_aliases(gpus, label, name):
    assert gpus.get(label).name == name


def test_model_lookup_ignores_org_case_and_suffixes(models):
    assert models.get("meta-llama/Meta-Llama-3.1-8B").name == "meta-llama/Llama-3.1-8B-Instruct"
    assert models.get("META-LLAMA/META-LLAMA-3.1-70B-INSTRUCT").total_b_params == pytest.approx(70.6)


def test_unknown_names_say_where_was_searched_and_how_to_add(gpus, models):
    with pytest.raises(tables.SpecError, match=r"gpu_features\.csv.*gpu_specs_extra\.csv.*--gpu-specs"):
        gpus.get("TPU v5e")
    with pytest.raises(tables.SpecError, match=r"model_features\.csv.*--model-specs"):
        models.get("acme/nonexistent-1b")


def _gpu(**kw):
    base = dict(name="X", base_clock_mhz=1000.0, boost_clock_mhz=1500.0, memory_size_gb=80.0,
                memory_bandwidth_gb_s=2000.0, memory_type="HBM3", thermal_design_power_w=500.0,
                tensor_tflops=500.0, release_year=2023.0)
    return tables.GpuSpec(**{**base, **kw})


@pytest.mark.parametrize("field,value", [("memory_bandwidth_gb_s", 3.35), ("memory_size_gb", 80e9),
                                         ("thermal_design_power_w", 0.7), ("tensor_tflops", 989e12)])
def test_impossible_units_are_rejected(field, value):
    with pytest.raises(tables.SpecError, match=field):
        _gpu(**{field: value})


def test_user_spec_file_with_wrong_units_is_rejected(tmp_path):
    f = tmp_path / "g.csv"
    f.write_text("gpu_type;memory_bandwidth_gb_s;thermal_design_power_w\nMy GPU;3.2;300\n")
    with pytest.raises(tables.SpecError, match="memory_bandwidth_gb_s=3.2"):
        tables.load_gpus((f,))


def test_missing_figures_stay_missing(gpus, models):
    sn = gpus.get("SambaNova SN40L")
    row = features.feature_row(sn, models.get("meta-llama/Meta-Llama-3-8B"), OperatingPoint())
    bw = features.FEATURES.index("memory_bandwidth_gb_s")
    assert math.isnan(row[bw]) and math.isnan(row[features.FEATURES.index("bandwidth_latency_s")])
    assert not math.isnan(row[features.FEATURES.index("compute_latency_s")])


def test_latency_terms_in_seconds(gpus, models):
    h100, llama = gpus.get("H100 SXM"), models.get("meta-llama/Meta-Llama-3-8B")
    # 2 bytes x 8.03e9 params / 3350e9 B/s = 4.79 ms per full read of the weights; half on 2 GPUs
    assert features.bandwidth_latency_s(h100, llama, 1) == pytest.approx(2 * 8.03 / 3350)
    assert features.bandwidth_latency_s(h100, llama, 2) == pytest.approx(2 * 8.03 / 3350 / 2)
    # 2 FLOP x 8.03e9 x 32 sequences / 989e12 FLOP/s
    assert features.compute_latency_s(h100, llama, 1, 32) == pytest.approx(2 * 8.03e9 * 32 / 989e12)


def test_operating_point_validates():
    with pytest.raises(ValueError, match="scenario"):
        OperatingPoint(scenario="batchy")
    with pytest.raises(ValueError, match="batch"):
        OperatingPoint(batch=0)
