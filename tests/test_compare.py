"""The first differing bit of two results, as the mismatch messages print it."""

import ml_dtypes
import numpy as np
import pytest

from kq_core.compare import first_mismatch
from kq_core.contract import RouteShedResult


def _result(mix, miss_scores):
    ids = np.array([[3, 1]], np.int32)
    return RouteShedResult(ids, np.asarray(mix), np.array([[7, -1]], np.int32), np.asarray(miss_scores))


def test_a_float32_mismatch_prints_its_bits_and_a_plain_value():
    expected = _result(np.array([[0.75, 0.25]], np.float32), np.array([[0.5, 0.0]], np.float32))
    got = _result(np.array([[0.75, -0.0]], np.float32), np.array([[0.5, 0.0]], np.float32))
    assert str(first_mismatch(expected, got)) == "mix[0, 1]: expected 0x3e800000 (0.25), got 0x80000000 (-0.0)"


@pytest.mark.parametrize("dtype, bits", [(np.float16, "0x3800"), (ml_dtypes.bfloat16, "0x3f00")])
def test_a_16_bit_mismatch_prints_its_16_bits_and_a_plain_value(dtype, bits):
    expected = _result(np.array([[0.75, 0.25]], np.float32), np.array([[0.5, 0.125]], dtype))
    got = _result(np.array([[0.75, 0.25]], np.float32), np.array([[np.nan, 0.125]], dtype))
    text = str(first_mismatch(expected, got))
    assert text.startswith(f"miss_scores[0, 0]: expected {bits} (0.5), got 0x") and text.endswith(" (nan)"), text


def test_an_integer_mismatch_prints_a_plain_int():
    mix = np.array([[0.75, 0.25]], np.float32)
    expected, got = _result(mix, mix), _result(mix, mix)
    got = got._replace(miss_ids=np.array([[7, 5]], np.int32))
    assert str(first_mismatch(expected, got)) == "miss_ids[0, 1]: expected -1, got 5"
