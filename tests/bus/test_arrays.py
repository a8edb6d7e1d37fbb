"""The array checks every decoded message runs: finiteness must agree with numpy's, at every length and position."""

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.arrays import check_finite


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float32, np.float64]), st.integers(0, 5000),
                  elements=st.floats(width=32, allow_subnormal=True)))
def test_check_finite_agrees_with_numpy(values):
    if np.isfinite(values).all():
        check_finite(values=values)
    else:
        with pytest.raises(ValueError, match="values are not all finite"):
            check_finite(values=values)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_bad_value_anywhere_is_found(bad):
    for n in range(1, 70):
        for position in range(n):
            values = np.full(n, np.finfo(np.float32).max, np.float32)  # finite, however large
            values[position] = bad
            with pytest.raises(ValueError):
                check_finite(values=values)


def test_extreme_finite_values_pass():
    info = np.finfo(np.float32)
    check_finite(values=np.array([info.max, -info.max, info.tiny, info.smallest_subnormal, 0.0, -0.0] * 1000,
                                 np.float32), absent=None)
