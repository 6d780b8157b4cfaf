"""The compiled bookkeeping's pieces that must match NumPy bit for bit on their own."""

import numpy as np
import pytest

numba_bookkeeping = pytest.importorskip("kq_host.bookkeeping_numba")


@pytest.mark.parametrize("size", [1, 2, 7, 8, 9, 15, 16, 17, 64, 127, 128, 129, 136, 255, 256, 257, 1000, 4099])
def test_sums_add_in_numpys_order(size):
    """The masses' sums take NumPy's pairwise order, so the statistics match the NumPy path's bits:
    random magnitudes over twelve decades (where the order shows), signed zeros, NaN-free."""
    rng = np.random.default_rng(size)
    for trial in range(200):
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-6, 6, size)
        if trial % 20 == 0:
            values[:] = -0.0
        assert np.float64(numba_bookkeeping._numpy_sum(values)).view(np.int64) == values.sum().view(np.int64), trial
