"""bench/percentile.py: the bootstrap's percentile interval, widened to hold the point estimate."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from unbroken.bench.percentile import percentile_interval

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=200), finite, st.floats(min_value=0.5, max_value=0.99))
def test_the_interval_is_ordered_and_holds_the_point(samples, point, level):
    lo, hi = percentile_interval(samples, point, level=level)
    assert lo <= point <= hi
    assert lo <= hi


def test_a_point_inside_the_quantiles_leaves_them_as_they_are():
    samples = np.arange(1001, dtype=float)  # quantiles 25 and 975 exactly
    assert percentile_interval(samples, 500.0) == pytest.approx((25.0, 975.0))


def test_a_point_outside_widens_only_its_own_side():
    samples = np.arange(1001, dtype=float)
    assert percentile_interval(samples, 990.0) == pytest.approx((25.0, 990.0))
    assert percentile_interval(samples, 3.0) == pytest.approx((3.0, 975.0))


@pytest.mark.parametrize("level", [0, 1, 1.5, -0.1])
def test_a_level_outside_zero_one_is_refused(level):
    with pytest.raises(ValueError, match="level must be in"):
        percentile_interval([1.0, 2.0], 1.5, level=level)
