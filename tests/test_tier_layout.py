"""The tier's storage layout: mlx-community's (16-bit scales and biases, ``mx.quantize``'s rounding), its
memory per weight, and a tier read from a lower-bit mlx-lm conversion of the same model."""

import json

import ml_dtypes
import numpy as np
import pytest

from kq_host.tier import BITS, GROUP_SIZES, TierOptionError, bits_per_weight, dequantize, quantize

mx = pytest.importorskip("mlx.core")

MX_DTYPES = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}


def _mlx_quantize(weight: np.ndarray, bits: int, group_size: int):
    """``mx.quantize`` of ``weight`` as a 16-bit MLX array (float32 and float64 weights rounded to bfloat16
    first, as ``mlx_lm.convert`` rounds a model to its dtype before quantizing), its results as NumPy arrays."""
    target = weight.dtype if weight.dtype in MX_DTYPES else np.dtype(ml_dtypes.bfloat16)
    values = mx.array(np.asarray(weight, np.float32)).astype(getattr(mx, MX_DTYPES[target]))
    packed, scales, biases = mx.quantize(values, group_size=group_size, bits=bits)
    as_numpy = [np.array(scales.view(mx.uint16)).view(target), np.array(biases.view(mx.uint16)).view(target)]
    return np.array(packed), *as_numpy


def _assert_is_mlx(weight, bits, group_size):
    ours = quantize(weight, bits=bits, group_size=group_size)
    theirs = _mlx_quantize(weight, bits, group_size)
    for field, a, b in zip(("packed", "scales", "biases"), ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, (field, a.dtype, a.shape, b.dtype, b.shape)
        different = np.flatnonzero(a.reshape(-1).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")
                                   != b.reshape(-1).view(f"u{b.dtype.itemsize}"))
        assert different.size == 0, f"{field} differs at {different[:8]}: {a.reshape(-1)[different[:4]]} " \
                                    f"vs {b.reshape(-1)[different[:4]]}"
    return ours


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_quantize_is_mx_quantize_bit_for_bit_on_random_weights(rng, bits, group_size, dtype):
    weight = (rng.normal(size=(24, 256)) * rng.uniform(1e-3, 4, (24, 1)) + rng.normal(size=(24, 1)) * 0.05)
    _assert_is_mlx(weight.astype(dtype), bits, group_size)


def _adversarial_groups(group_size: int) -> np.ndarray:
    """Rows of one group each: the corners of MLX's scale and bias computation."""
    rng = np.random.default_rng(7)
    base = rng.normal(size=group_size)
    rows = [
        np.zeros(group_size), np.full(group_size, 0.375), np.full(group_size, -2.5),  # constant groups
        np.full(group_size, 1e-30), np.full(group_size, 3e-8),  # constants below eps: q0 rounds to 0
        base, -base, np.abs(base), -np.abs(base),  # one sign only: the edge at the far end
        np.linspace(-1, 1, group_size), np.linspace(-1, 0.5, group_size), np.linspace(-0.5, 1, group_size),
        np.where(np.arange(group_size) == 3, 100.0, base * 1e-3),  # one outlier
        np.where(np.arange(group_size) == 0, -1.0, 1.0),  # |min| == |max|: the tie picks the max
        base * 1e-9, base * 1e-6 + 1.0,  # ranges below eps * levels
        base * 1e3 + 1e4, np.linspace(0, 3, group_size),  # large values; levels on exact halves
        np.arange(group_size) * 0.5 - 7.75, np.full(group_size, 6e-5) * np.sign(base),  # halves; f16 subnormals
    ]
    return np.stack(rows)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_quantize_is_mx_quantize_bit_for_bit_on_adversarial_weights(bits, group_size, dtype):
    weight = _adversarial_groups(group_size).astype(dtype)
    ours = _assert_is_mlx(weight, bits, group_size)
    back = dequantize(ours, bits=bits, group_size=group_size)
    assert np.all(np.isfinite(back))
    # A constant group comes back exactly, one of magnitude below half of mx.quantize's smallest scale (1e-7) as 0.
    value = weight[:, 0].astype(np.float32)
    constant = np.all(weight == weight[:, :1], axis=1)
    on_grid, tiny = constant & (np.abs(value) >= 1e-7), constant & (np.abs(value) < 5e-8)
    assert on_grid.sum() >= 2 and tiny.sum() >= 2
    assert back[on_grid].tobytes() == weight[on_grid].astype(np.float32).tobytes()
    assert not np.any(back[tiny])


@pytest.mark.parametrize("bits", BITS)
def test_float16s_widest_range_is_mx_quantize_and_dequantizes_finite(bits):
    weight = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32).astype(np.float16)
    weight[:, 0], weight[:, -1] = -65504, 65504
    back = dequantize(_assert_is_mlx(weight, bits, 32), bits=bits, group_size=32)
    assert np.all(np.isfinite(back)) and np.all(back.max(axis=1) == 65504)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wider_weights_are_rounded_to_bfloat16_before_they_are_quantized(rng, dtype):
    weight = rng.normal(size=(4, 64)).astype(dtype)
    got = quantize(weight, bits=3, group_size=32)
    want = quantize(weight.astype(np.float32).astype(ml_dtypes.bfloat16), bits=3, group_size=32)
    assert got.scales.dtype == got.biases.dtype == np.dtype(ml_dtypes.bfloat16)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_values_beyond_bfloat16s_range_are_refused():
    weight = np.ones((1, 32), np.float32)
    weight[0, 5] = np.float32(3.4e38)  # finite in float32, inf in bfloat16
    with pytest.raises(TierOptionError, match="bfloat16"):
        quantize(weight, bits=4, group_size=32)


@pytest.mark.parametrize("bits, group_size, want", [(2, 32, 3.0), (2, 64, 2.5), (2, 128, 2.25), (3, 32, 4.0),
                                                    (3, 64, 3.5), (4, 32, 5.0), (4, 64, 4.5), (8, 64, 8.5)])
def test_a_weight_costs_its_bits_and_two_16_bit_numbers_a_group(rng, bits, group_size, want):
    assert bits_per_weight(bits, group_size) == want
    weight = rng.normal(size=(8, 256)).astype(np.float32)
    quantized = quantize(weight, bits=bits, group_size=group_size)
    assert quantized.nbytes * 8 / weight.size == want


def test_bits_per_weight_names_a_bad_option():
    with pytest.raises(TierOptionError, match="group_size"):
        bits_per_weight(2, 48)
