"""The integer-mantissa multiply and divide against NumPy's IEEE f32 (then flushed)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from kq.oracle import flush  # noqa: E402
from kq_jax.exact_f32 import div_flush_raw, mul_flush_raw  # noqa: E402


def operands(rng, n):
    """Random bit patterns, biased towards the exponents where rounding is delicate."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    zone = rng.random(n)
    near = rng.integers(0, 40, n).astype(np.uint32)
    bits = np.where(zone < 0.3, (bits & 0x807FFFFF) | (near << 23), bits)  # tiny exponents
    bits = np.where((zone >= 0.3) & (zone < 0.5), (bits & 0x807FFFFF) | ((107 + near) << 23), bits)  # near 1
    bits = np.where((zone >= 0.5) & (zone < 0.55), (bits & 0x80000000) | (0x7FFFF0 + near), bits)  # near 2^-126
    bits = np.where((zone >= 0.55) & (zone < 0.6), (bits & 0x807FFFFF) | ((215 + near) << 23), bits)  # huge
    return flush(bits.view(np.float32))


def assert_equal_bits(want, got):
    want_bits, got_bits = want.view(np.uint32), np.asarray(got).view(np.uint32)
    # Input NaNs may carry any payload in NumPy's answer; the contract canonicalises them later.
    differs = (want_bits != got_bits) & ~(np.isnan(want) & np.isnan(np.asarray(got)))
    assert not differs.any(), f"{differs.sum()} differ, first at {np.flatnonzero(differs)[:5]}"


@pytest.mark.parametrize("op, numpy_op", [(mul_flush_raw, np.multiply), (div_flush_raw, np.divide)],
                         ids=["mul", "div"])
def test_random_operands(op, numpy_op):
    rng = np.random.default_rng(7)
    fn = jax.jit(op)
    for _ in range(4):
        a, b = operands(rng, 2_000_000), operands(rng, 2_000_000)
        with np.errstate(all="ignore"):
            want = flush(numpy_op(a, b))
        assert_equal_bits(want, fn(a, b))


def test_products_that_ieee_rounds_up_to_the_smallest_normal():
    a = np.array([1 - 2**-24, 2**-126, 1 - 2**-23, 0.5], np.float32)
    b = np.array([2**-126, 1 - 2**-24, 2**-126 * (1 + 2**-23), 2**-125 * (1 - 2**-24)], np.float32)
    want = flush(a * b)
    assert (want.view(np.uint32) == 0x00800000).sum() >= 2
    assert_equal_bits(want, jax.jit(mul_flush_raw)(a, b))


def test_special_operands():
    values = np.array([0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4e38, 2**-126, -2**-126], np.float32)
    a, b = (x.reshape(-1) for x in np.meshgrid(values, values))
    with np.errstate(all="ignore"):
        assert_equal_bits(flush(a * b), jax.jit(mul_flush_raw)(a, b))
        assert_equal_bits(flush(a / b), jax.jit(div_flush_raw)(a, b))
