"""The codec and the array checks every decoded message runs: msgspec must write the bytes msgpack-python wrote (old
readers and recorded runs read them), finiteness must agree with numpy's, at every length and position."""

import hypothesis.extra.numpy as hnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.arrays import check_finite, packb, to_wire, unpackb

plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text() | st.integers(0, 99), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(plain_values)
def test_packb_writes_the_bytes_msgpack_python_wrote_and_reads_them_back(value):
    assert packb(value) == msgpack.packb(value, use_bin_type=True)
    assert msgpack.packb(unpackb(packb(value)), use_bin_type=True) == packb(value)  # NaN-proof: compare bytes


def test_arrays_and_numpy_scalars_go_as_msgpack_python_sent_them():
    array = np.arange(5, dtype=np.float32)
    assert packb({"a": array, "n": np.int64(3)}) == msgpack.packb({"a": to_wire(array), "n": 3}, use_bin_type=True)


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
