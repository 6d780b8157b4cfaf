"""Correctly rounded, flushed f32 multiply and divide built from integer ops.

Why not ``a * b`` and ``a / b``? Because no JAX backend gives the contract's
bits for them on every input:

* XLA's GPU backend (and Pallas' Triton lowering) emit an approximate f32
  division: ``3163.328613 / 3163.328613`` gives 0.99999994.
* XLA's CPU backend runs with flush-to-zero, and it decides tininess *after*
  rounding to 24 bits: ``(1 - 2**-24) * 2**-126`` gives 0 there, where IEEE
  rounds it up to the normal 2**-126 that the contract keeps.

Integer arithmetic has no such latitude on any backend, so the two operations
the contract rounds (``s * scale`` and ``total / kept``) are computed here on
the mantissas as uint32, rounded to nearest even, and flushed exactly like
``flush(x)`` in the contract. (The Pallas kernel on a CUDA GPU uses PTX's IEEE
``mul.rn.f32`` / ``div.rn.f32`` instead; see :mod:`kq_jax.route_shed_pallas`.)
Addition needs no such care: a sum of two normal floats that lands below
2**-126 is exact, so hardware FTZ and the contract's flush agree on it.

The functions take and return float32 arrays whose inputs are already flushed
(no subnormals, no -0.0) and only use ops that Pallas' Triton lowering
supports, so the same code runs in ``jax.jit``, in a Pallas kernel body and in
Pallas' interpret mode. ``mul_flush`` and ``div_flush`` carry the ordinary
derivatives so that autodiff through the reference works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kq_core.contract import CANONICAL_NAN_BITS, F32_MIN_NORMAL

_CANONICAL_NAN = np.uint32(CANONICAL_NAN_BITS).view(np.float32)
_U32 = jnp.uint32
_I32 = jnp.int32


def _u32(value: int):
    return jnp.asarray(value, _U32)


def _bits(x):
    return lax.bitcast_convert_type(x, _U32)


def _float(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def flush(x):
    """Maps |x| < 2**-126 (subnormals, -0.0) to +0.0; keeps NaN and inf."""
    return jnp.where(jnp.abs(x) < F32_MIN_NORMAL, jnp.float32(0.0), x)


def canonicalize_nan(x):
    """Replaces every NaN by the quiet NaN 0x7FC00000."""
    # A float literal, not a bitcast of an integer constant: Triton's lowering
    # cannot bitcast constants. NumPy's NaN literal is exactly 0x7FC00000.
    return jnp.where(jnp.isnan(x), _CANONICAL_NAN, x)


def _fields(x):
    bits = _bits(x)
    sign = bits >> 31
    exponent = ((bits >> 23) & 0xFF).astype(_I32)
    # The hidden bit is set even for zeros, so mantissas are never 0 and the
    # integer division below never divides by zero on lanes that are unused.
    mantissa = (bits & 0x7FFFFF) | 0x800000
    return sign, exponent, mantissa


def _round_pack(sign, exponent, mantissa, round_bit, sticky):
    """Packs ``(-1)**sign * mantissa.round_sticky * 2**(exponent-150)`` as flushed f32.

    ``mantissa`` is a 24-bit integer in [2**23, 2**24); ``exponent`` the
    biased exponent before rounding (may be outside [1, 254]).
    """
    round_up = round_bit & (sticky | (mantissa & 1))
    rounded = mantissa + round_up
    carry = rounded >> 24
    rounded = jnp.where(carry == 1, rounded >> 1, rounded)
    biased = exponent + carry.astype(_I32)
    normal = (sign << 31) | (biased.astype(_U32) << 23) | (rounded & 0x7FFFFF)
    infinite = (sign << 31) | 0x7F800000
    # Biased exponent 0 is the top binade of subnormals; IEEE rounds it (on
    # the 2**-149 grid) up to 2**-126 only when every mantissa bit is set.
    up_to_normal = (exponent == 0) & (mantissa == 0xFFFFFF)
    bits = jnp.where(
        exponent >= 1,
        jnp.where(biased >= 255, infinite, normal),
        jnp.where(up_to_normal, (sign << 31) | 0x00800000, _u32(0)),
    )
    return _float(bits)


def _special(nan, inf, zero, sign):
    """The IEEE answer for the lanes where an operand is 0, inf or NaN."""
    nan_bits = _u32(CANONICAL_NAN_BITS)
    bits = jnp.where(nan, nan_bits, jnp.where(inf, (sign << 31) | 0x7F800000, _u32(0)))
    return bits, nan | inf | zero


def mul_flush_raw(a, b):
    """``flush(a * b)`` correctly rounded, for flushed f32 ``a``, ``b`` (no autodiff)."""
    sign_a, exp_a, man_a = _fields(a)
    sign_b, exp_b, man_b = _fields(b)
    sign = sign_a ^ sign_b
    # 24 x 24 -> 48-bit product from 12-bit halves, all partial sums < 2**32.
    a_hi, a_lo = man_a >> 12, man_a & 0xFFF
    b_hi, b_lo = man_b >> 12, man_b & 0xFFF
    middle = a_hi * b_lo + a_lo * b_hi
    low = a_lo * b_lo + ((middle & 0xFFF) << 12)
    high = a_hi * b_hi + (middle >> 12) + (low >> 24)
    low = low & 0xFFFFFF
    top = (high >> 23) == 1  # product >= 2**47: already normalised
    mantissa = jnp.where(top, high, (high << 1) | (low >> 23))
    round_bit = jnp.where(top, low >> 23, (low >> 22) & 1)
    sticky = jnp.where(top, (low & 0x7FFFFF) != 0, (low & 0x3FFFFF) != 0).astype(_U32)
    exponent = exp_a + exp_b - jnp.where(top, 126, 127)
    finite = _round_pack(sign, exponent, mantissa, round_bit, sticky)

    a_nan, b_nan = jnp.isnan(a), jnp.isnan(b)
    a_inf, b_inf = jnp.isinf(a), jnp.isinf(b)
    a_zero, b_zero = a == 0, b == 0
    nan = a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf)
    inf = (a_inf | b_inf) & ~nan
    special_bits, is_special = _special(nan, inf, a_zero | b_zero, sign)
    return jnp.where(is_special, _float(special_bits), finite)


def div_flush_raw(a, b):
    """``flush(a / b)`` correctly rounded, for flushed f32 ``a``, ``b`` (no autodiff)."""
    sign_a, exp_a, man_a = _fields(a)
    sign_b, exp_b, man_b = _fields(b)
    sign = sign_a ^ sign_b
    shift = man_a < man_b
    numerator = jnp.where(shift, man_a << 1, man_a)  # numerator / man_b in [1, 2)
    exponent = exp_a - exp_b + jnp.where(shift, 126, 127)
    # Long division, 8 quotient bits per step, remainders stay below 2**32.
    quotient = jnp.ones_like(man_a)
    remainder = numerator - man_b
    for _ in range(3):
        widened = remainder << 8
        digit = widened // man_b
        remainder = widened - digit * man_b
        quotient = (quotient << 8) | digit
    finite = _round_pack(sign, exponent, quotient >> 1, quotient & 1, (remainder != 0).astype(_U32))

    a_nan, b_nan = jnp.isnan(a), jnp.isnan(b)
    a_inf, b_inf = jnp.isinf(a), jnp.isinf(b)
    a_zero, b_zero = a == 0, b == 0
    nan = a_nan | b_nan | (a_inf & b_inf) | (a_zero & b_zero)
    inf = (a_inf | b_zero) & ~nan
    special_bits, is_special = _special(nan, inf, a_zero | b_inf, sign)
    return jnp.where(is_special, _float(special_bits), finite)


@jax.custom_jvp
def mul_flush(a, b):
    """Differentiable :func:`mul_flush_raw`; its tangent is that of ``a * b``."""
    return mul_flush_raw(a, b)


@mul_flush.defjvp
def _mul_flush_jvp(primals, tangents):
    a, b = primals
    da, db = tangents
    return mul_flush_raw(a, b), da * b + a * db


@jax.custom_jvp
def div_flush(a, b):
    """Differentiable :func:`div_flush_raw`; its tangent is that of ``a / b``."""
    return div_flush_raw(a, b)


@div_flush.defjvp
def _div_flush_jvp(primals, tangents):
    a, b = primals
    da, db = tangents
    quotient = div_flush_raw(a, b)
    return quotient, (da - quotient * db) / b
