"""The low-precision tier: its format (MLX's layout), its cache, and the JAX layer that serves misses from it."""

import ml_dtypes
import numpy as np
import pytest

from kq_host.tier import (BITS, QuantizedWeight, TierOptionError, build_tier, dequantize, pack, quantize,
                          unpack)


@pytest.mark.parametrize("bits", BITS)
def test_pack_is_a_little_endian_bit_stream_and_unpacks(rng, bits):
    q = rng.integers(0, 1 << bits, (3, 64), dtype=np.uint32)
    packed = pack(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 64 * bits // 32)
    np.testing.assert_array_equal(unpack(packed, bits), q)
    # Value i occupies bits [i * bits, (i + 1) * bits) of the row's stream.
    stream = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    first = sum(int(stream[0, j]) << j for j in range(bits))
    assert first == q[0, 0]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_quantize_error_is_within_a_step_of_the_range_and_the_scale_rounding(rng, bits, group_size, dtype):
    weight = (rng.normal(size=(5, 128)) * rng.uniform(0.01, 3, (5, 1))).astype(dtype)
    quantized = quantize(weight, bits=bits, group_size=group_size)
    assert quantized.scales.dtype == weight.dtype and quantized.scales.shape == (5, 128 // group_size)
    back = dequantize(quantized, bits=bits, group_size=group_size)
    groups = weight.astype(np.float32).reshape(5, -1, group_size)
    step = np.repeat((groups.max(-1) - groups.min(-1)) / ((1 << bits) - 1), group_size, axis=-1)
    # mx.quantize puts the group's edge and zero on the grid: a value is at most half a grid step off, and the
    # far end, where the grid may fall short of it, less than (range / levels) off. q is rounded against the
    # float32 scale, stored rounded to 16 bits: each level moves by at most q * |scale| * 2**-precision.
    precision = 8 if weight.dtype == ml_dtypes.bfloat16 else 11
    q = unpack(quantized.packed, bits).astype(np.float32)
    scale = np.repeat(np.abs(quantized.scales.astype(np.float32)), group_size, axis=-1)
    error = np.abs(back - weight.astype(np.float32))
    assert np.all(error <= step + q * scale * 2.0**-precision)
    assert np.median(error / step) < 0.3  # most values round to their nearest level


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_scale_times_q_is_exact_in_float32(rng, dtype):
    """So a backend that fuses dequantization's multiply and add into an FMA gets the same weights."""
    weight = (rng.normal(size=(64, 128)) * 0.37).astype(dtype)
    quantized = quantize(weight, bits=8, group_size=32)
    assert quantized.scales.dtype.itemsize == 2
    q = unpack(quantized.packed, 8).reshape(64, 4, 32).astype(np.float64)
    product = q * quantized.scales.astype(np.float64)[..., None]
    assert np.array_equal(product.astype(np.float32).astype(np.float64), product)


def test_a_constant_group_comes_back_exactly():
    weight = np.full((2, 32), 0.375, np.float32)
    quantized = quantize(weight, bits=2, group_size=32)
    assert dequantize(quantized, bits=2, group_size=32).tobytes() == weight.tobytes()


def test_mlx_dequantizes_the_format_to_the_reference_bits(rng):
    mx = pytest.importorskip("mlx.core")
    weight = rng.normal(size=(8, 128)).astype(np.float32)
    for bits in (2, 3, 4, 8):
        quantized = quantize(weight, bits=bits, group_size=32)
        widened = [mx.array(quantized.packed), *(mx.array(a.astype(np.float32)) for a in quantized[1:])]
        theirs = np.array(mx.dequantize(*widened, group_size=32, bits=bits))
        assert theirs.dtype == np.float32
        assert theirs.tobytes() == dequantize(quantized, bits=bits, group_size=32).tobytes()


@pytest.mark.parametrize("options, argument", [({"bits": 5, "group_size": 32}, "bits"),
                                               ({"bits": True, "group_size": 32}, "bits"),
                                               ({"bits": 4, "group_size": 48}, "group_size")])
def test_bad_options_name_the_argument(options, argument):
    with pytest.raises(TierOptionError, match=argument):
        quantize(np.zeros((2, 96), np.float32), **options)


def test_bad_weights_are_refused():
    with pytest.raises(TierOptionError, match="multiple of group_size"):
        quantize(np.zeros((2, 40), np.float32), bits=4, group_size=32)
    with pytest.raises(TierOptionError, match="inf or NaN"):
        quantize(np.full((1, 32), np.nan, np.float32), bits=4, group_size=32)


def _write_checkpoint(path, rng, layers=2, experts=4, hidden=64, ffn=32):
    from safetensors.numpy import save_file

    tensors = {}
    for layer in range(layers):
        for expert in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            tensors[f"{prefix}.gate_proj.weight"] = rng.normal(size=(ffn, hidden)).astype(np.float32)
            tensors[f"{prefix}.up_proj.weight"] = rng.normal(size=(ffn, hidden)).astype(np.float32)
            tensors[f"{prefix}.down_proj.weight"] = rng.normal(size=(hidden, ffn)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_build_tier_quantizes_every_expert_and_caches_it(tmp_path, rng):
    from kq_host.expert_store import ExpertStore

    (tmp_path / "ckpt").mkdir()
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"
    with ExpertStore(tmp_path / "ckpt") as store:
        tier = build_tier(store, 2, 4, bits=3, group_size=32, cache_dir=cache)
        assert tier.num_layers == 2 and tier.num_experts == 4
        down = tier.weights["down_proj"]
        want = quantize(tensors["model.layers.1.mlp.experts.2.down_proj.weight"], bits=3, group_size=32)
        for got, expected in zip(QuantizedWeight(*(a[1, 2] for a in down)), want):
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
        assert len(list(cache.iterdir())) == 1
        again = build_tier(store, 2, 4, bits=3, group_size=32, cache_dir=cache)
        for name in tier.weights:
            for a, b in zip(tier.weights[name], again.weights[name]):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        build_tier(store, 2, 4, bits=2, group_size=32, cache_dir=cache)
        assert len(list(cache.iterdir())) == 2  # other options, another entry
    assert tier.nbytes == sum(w.nbytes for w in tier.weights.values())


def test_build_tier_refuses_bad_counts(tmp_path, rng):
    from kq_host.expert_store import ExpertStore

    _write_checkpoint(tmp_path, rng)
    with ExpertStore(tmp_path) as store:
        with pytest.raises(TierOptionError, match="num_experts"):
            build_tier(store, 2, 0, cache_dir=tmp_path / "c")


# ---- the JAX layer ------------------------------------------------------------------------------


def _layer(rng, experts=16, hidden=64, ffn=32, tokens=5):
    jnp = pytest.importorskip("jax.numpy")
    from kq_jax.moe import Experts

    full = Experts(*(jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.2)
                     for shape in ((experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn))))
    x = jnp.asarray(rng.normal(size=(tokens, hidden)).astype(np.float32))
    router = jnp.asarray(rng.normal(size=(hidden, experts)).astype(np.float32))
    return x, router, full


def _tier_of(full, bits, group_size):
    from kq_jax.moe import tier_experts

    names = ("gate_proj", "up_proj", "down_proj")
    layer = {name: quantize(np.asarray(w), bits=bits, group_size=group_size) for name, w in zip(names, full)}
    return layer, tier_experts(layer, bits=bits, group_size=group_size)


@pytest.mark.parametrize("bits", BITS)
def test_jax_dequantize_in_the_gather_matches_the_host_reference(rng, bits):
    jnp = pytest.importorskip("jax.numpy")
    from kq_jax.moe import dequantize_rows

    _, _, full = _layer(rng)
    layer, tier = _tier_of(full, bits, 32)
    rows = jnp.asarray([[3, 0], [15, 7]])
    got = np.asarray(dequantize_rows(tier.down, rows, bits=bits, group_size=32, dtype=jnp.float32))
    want = dequantize(layer["down_proj"], bits=bits, group_size=32)[np.asarray(rows)]
    assert got.tobytes() == want.tobytes()


def test_tiered_layer_with_every_expert_resident_is_the_resident_layer(rng):
    jax = pytest.importorskip("jax")
    from kq_jax.arena_moe import moe_ffn_tiered
    from kq_jax.moe import moe_ffn_resident

    x, router, full = _layer(rng)
    _, tier = _tier_of(full, 3, 32)
    table = np.arange(16, dtype=np.int32)[::-1].copy()  # every expert resident, slots permuted
    arena = type(full)(*(w[np.argsort(table)] for w in full))  # slot s holds the expert whose table entry is s
    want = np.asarray(jax.jit(lambda x: moe_ffn_resident(x, router, full, top_k=4))(x))
    got, routing = jax.jit(lambda x: moe_ffn_tiered(x, router, arena, tier, table, top_k=4))(x)
    assert np.asarray(got).tobytes() == want.tobytes()
    assert int(np.asarray(routing.shed.miss_ids).max()) == -1


@pytest.mark.parametrize("bits", [2, 4])
def test_tiered_layer_serves_misses_with_their_dequantized_copy(rng, bits):
    """The tiered layer is the resident layer over a mixed set of experts: full weights where resident, the
    tier's dequantized copy elsewhere. The same weights meet the same einsums, though XLA may fuse them
    otherwise (on a GPU it does), so the bound is float32 rounding, far below what dropping the misses costs."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from kq_jax.arena_moe import moe_ffn_arena, moe_ffn_tiered
    from kq_jax.moe import Experts, moe_ffn_resident

    x, router, full = _layer(rng)
    layer, tier = _tier_of(full, bits, 32)
    resident = np.array([0, 2, 3, 5, 8, 13], np.int32)  # six of 16 experts, in slots 0..5
    table = np.full(16, -1, np.int32)
    table[resident] = np.arange(resident.size, dtype=np.int32)
    arena = Experts(*(w[resident] for w in full))
    names = ("gate_proj", "up_proj", "down_proj")
    mixed = Experts(*(jnp.where(jnp.asarray(table >= 0)[:, None, None], w,
                                jnp.asarray(dequantize(layer[name], bits=bits, group_size=32)))
                      for w, name in zip(full, names)))
    want = np.asarray(jax.jit(lambda x: moe_ffn_resident(x, router, mixed, top_k=4))(x))
    got, routing = jax.jit(lambda x: moe_ffn_tiered(x, router, arena, tier, table, top_k=4))(x)
    assert (np.asarray(routing.shed.miss_ids) >= 0).any(), "the case must have misses"
    error = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    assert error < 1e-6
    dropped, _ = jax.jit(lambda x: moe_ffn_arena(x, router, arena, table, top_k=4))(x)
    assert np.abs(np.asarray(dropped) - want).max() / np.abs(want).max() > 1e-3


@pytest.mark.parametrize("bits", [3, 4])
def test_tiered_layer_gives_the_same_bits_eagerly_and_in_any_jitted_program(rng, bits):
    """A miss's tier entry is one fenced program: eager, jitted with the tier an argument or a constant of
    the program, and inside a larger program, the same bits (unfenced, XLA's CPU backend contracted its
    multiplies and adds into FMAs in some of these and not others)."""
    jax = pytest.importorskip("jax")
    from kq_jax.arena_moe import moe_ffn_tiered
    from kq_jax.moe import Experts

    x, router, full = _layer(rng)
    x = x * 37.0  # outputs far from 1, where a rounding difference shows in the last bits
    _, tier = _tier_of(full, bits, 32)
    resident = np.array([1, 4, 6, 9, 11], np.int32)
    table = np.full(16, -1, np.int32)
    table[resident] = np.arange(resident.size, dtype=np.int32)
    arena = Experts(*(w[resident] for w in full))

    def layer(x, arena, tier):
        return moe_ffn_tiered(x, router, arena, tier, table, top_k=4)

    eager, routing = layer(x, arena, tier)
    assert (np.asarray(routing.shed.miss_ids) >= 0).sum() >= 8, "the case must have misses"
    bits_of = lambda y: np.asarray(y).view(np.uint32)
    as_arguments = jax.jit(lambda x, arena, packed: layer(x, arena, tier._replace(gate=packed)))(x, arena, tier.gate)[0]
    as_constants = jax.jit(lambda x: layer(x, arena, tier))(x)[0]
    inside = jax.jit(lambda x: layer(x, arena, tier)[0] * 2.0)(x) / 2.0  # exact: a power of two
    for got in (as_arguments, as_constants, inside):
        np.testing.assert_array_equal(bits_of(got), bits_of(eager))


def test_a_tier_passed_to_jit_gives_the_bits_of_a_closed_over_one(rng):
    """bits and group_size are the tier's static data, its arrays its leaves: a TierExperts is a jit argument
    as it is a constant of the program, and tree_map / device_put keep its format."""
    jax = pytest.importorskip("jax")
    from kq_jax.arena_moe import moe_ffn_tiered
    from kq_jax.moe import Experts

    x, router, full = _layer(rng)
    _, tier = _tier_of(full, 3, 32)
    resident = np.array([1, 4, 6, 9, 11], np.int32)
    table = np.full(16, -1, np.int32)
    table[resident] = np.arange(resident.size, dtype=np.int32)
    arena = Experts(*(w[resident] for w in full))

    def layer(x, arena, tier):
        return moe_ffn_tiered(x, router, arena, tier, table, top_k=4)[0]

    closed_over = jax.jit(lambda x, arena: layer(x, arena, tier))(x, arena)
    passed = jax.jit(layer)(x, arena, tier)
    np.testing.assert_array_equal(np.asarray(passed).view(np.uint32), np.asarray(closed_over).view(np.uint32))
    assert len(jax.tree.leaves(tier)) == 9
    for moved in (jax.tree.map(lambda a: a, tier), jax.device_put(tier)):
        assert type(moved) is type(tier) and (moved.bits, moved.group_size) == (3, 32)
