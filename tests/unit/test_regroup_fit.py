"""Regroup vs ranks: the bench's least-squares fit (bench/regroup.py) and the simulator's use of it (sim/regroup_fit.py)."""
import json
import math

import pytest
from hypothesis import given, strategies as st

from unbroken.bench.regroup import fit, write_into_multinode
from unbroken.sim.calibrate import load_calibrations
from unbroken.sim.errors import SimError
from unbroken.sim.policies import Unbroken
from unbroken.sim.regroup_fit import apply_regroup_fit, regroup_fit_from_dict

SIZES = (4, 8, 16, 32, 64)


@given(st.floats(0.0, 1.0), st.floats(0.001, 0.5))
def test_a_log2_curve_is_recovered_exactly_and_chosen(a, b):
    res = fit([{"ranks": n, "regroup_s": a + b * math.log2(n)} for n in SIZES for _ in range(2)])
    assert res["model"] == "log2"
    assert res["constants"]["a_s"] == pytest.approx(a, abs=1e-9) and res["constants"]["b_s"] == pytest.approx(b)
    assert res["fits"]["log2"]["rss"] < res["fits"]["linear"]["rss"]


@given(st.floats(0.0, 1.0), st.floats(0.001, 0.05))
def test_a_linear_curve_is_chosen_as_linear(a, b):
    res = fit([{"ranks": n, "regroup_s": a + b * n} for n in SIZES])
    assert res["model"] == "linear" and res["constants"]["b_s"] == pytest.approx(b)
    assert res["median_by_ranks"]["64"] == pytest.approx(a + 64 * b)


def test_the_fit_lands_in_multinode_json_beside_what_is_there_and_calibrates_the_simulator(tmp_path):
    (tmp_path / "multinode.json").write_text(json.dumps({"rows": [1, 2], "commit": "abc"}))
    res = fit([{"ranks": n, "regroup_s": 0.05 + 0.01 * math.log2(n)} for n in SIZES])
    write_into_multinode(res, tmp_path / "multinode.json")
    data = json.loads((tmp_path / "multinode.json").read_text())
    assert data["rows"] == [1, 2] and data["commit"] == "abc" and "commit" in data["regroup_fit"]
    cal = load_calibrations([tmp_path / "multinode.json"])  # named explicitly: a directory does not opt in
    assert cal.regroup is not None and cal.recovery is None
    pol = apply_regroup_fit(Unbroken(), cal.regroup)
    assert pol.regroup_s(1024) == pytest.approx(0.05 + 0.01 * 10)
    assert pol.regroup_s(131072) == pytest.approx(0.05 + 0.01 * 17)


def test_a_linear_fit_grows_with_ranks_and_a_negative_intercept_floors_at_zero():
    fit_ = regroup_fit_from_dict({"regroup_fit": {"model": "linear", "constants": {"a_s": -0.5, "b_s": 0.001}}}, "m.json")
    pol = apply_regroup_fit(Unbroken(), fit_)
    assert pol.regroup_s(2) == 0.0 and pol.regroup_s(16384) == pytest.approx(-0.5 + 16.384)


@pytest.mark.parametrize("d,needle", [({}, "no 'regroup_fit'"),
                                      ({"regroup_fit": {"model": "cubic", "constants": {"a_s": 0, "b_s": 1}}}, "must be one of"),
                                      ({"regroup_fit": {"model": "log2", "constants": {"a_s": 0}}}, "a_s and b_s"),
                                      ({"regroup_fit": {"model": "log2", "constants": {"a_s": 0, "b_s": -1}}}, "b_s must be >= 0")])
def test_a_broken_fit_is_named(d, needle):
    with pytest.raises(SimError, match=needle):
        regroup_fit_from_dict(d, "m.json")
