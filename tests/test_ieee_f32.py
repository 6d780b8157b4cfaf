"""The kernels' rounded multiply and divide against NumPy's IEEE f32 (then flushed).

The integer-mantissa versions run everywhere; the PTX ``mul.rn`` / ``div.rn``
versions (``KernelConfig(ptx_arith=True)``) inside a Pallas kernel on a CUDA GPU.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax_impls import ON_GPU  # noqa: E402

from kq_core.oracle import flush  # noqa: E402
from kq_jax.ieee_f32 import div_flush_raw, mul_flush_raw  # noqa: E402

_BLOCK = 1024


def in_pallas_kernel(op):
    """``op`` applied elementwise inside a Pallas Triton kernel, on 1-D f32 arrays of any length."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(a_ref, b_ref, out_ref):
        out_ref[...] = op(a_ref[...], b_ref[...])

    @jax.jit
    def run(a, b):
        n = a.shape[0]
        padded = -(-n // _BLOCK) * _BLOCK
        a, b = (jax.numpy.pad(x, (0, padded - n), constant_values=1.0) for x in (a, b))
        spec = pl.BlockSpec((_BLOCK,), lambda i: (i,))
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((padded,), jax.numpy.float32),
                             grid=(padded // _BLOCK,), in_specs=[spec, spec], out_specs=spec,
                             compiler_params=plgpu.CompilerParams())(a, b)
        return out[:n]

    return run


def implementations():
    from kq_jax.route_shed_pallas import ptx_div_flush, ptx_mul_flush

    gpu_only = pytest.mark.skipif(not ON_GPU, reason="inline PTX runs on a CUDA GPU only")
    return [
        pytest.param(jax.jit(mul_flush_raw), np.multiply, id="integer-mul"),
        pytest.param(jax.jit(div_flush_raw), np.divide, id="integer-div"),
        pytest.param(in_pallas_kernel(ptx_mul_flush), np.multiply, id="ptx-mul", marks=gpu_only),
        pytest.param(in_pallas_kernel(ptx_div_flush), np.divide, id="ptx-div", marks=gpu_only),
    ]


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


@pytest.mark.parametrize("fn, numpy_op", implementations())
def test_random_operands(fn, numpy_op):
    rng = np.random.default_rng(7)
    for _ in range(4):
        a, b = operands(rng, 2_000_000), operands(rng, 2_000_000)
        with np.errstate(all="ignore"):
            want = flush(numpy_op(a, b))
        assert_equal_bits(want, fn(a, b))


@pytest.mark.parametrize("fn, numpy_op", [p for p in implementations() if p.values[1] is np.multiply])
def test_products_that_ieee_rounds_up_to_the_smallest_normal(fn, numpy_op):
    a = np.array([1 - 2**-24, 2**-126, 1 - 2**-23, 0.5], np.float32)
    b = np.array([2**-126, 1 - 2**-24, 2**-126 * (1 + 2**-23), 2**-125 * (1 - 2**-24)], np.float32)
    want = flush(numpy_op(a, b))
    assert (want.view(np.uint32) == 0x00800000).sum() >= 2
    assert_equal_bits(want, fn(a, b))


@pytest.mark.parametrize("fn, numpy_op", implementations())
def test_special_operands(fn, numpy_op):
    values = np.array([0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4e38, 2**-126, -2**-126], np.float32)
    a, b = (x.reshape(-1) for x in np.meshgrid(values, values))
    with np.errstate(all="ignore"):
        assert_equal_bits(flush(numpy_op(a, b)), fn(a, b))
