"""The tier's storage layout: mlx-community's (16-bit scales and biases, ``mx.quantize``'s rounding), its
memory per weight, and a tier read from a lower-bit mlx-lm conversion of the same model."""

import json

import ml_dtypes
import numpy as np
import pytest

from kq_host.expert_store import ExpertStoreError
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


# ---- a tier read from a lower-bit mlx-lm conversion ----------------------------------------------

TINY = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2, head_dim=16,
            rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128, norm_topk_prob=True)
FLOAT_TEMPLATE = "model.layers.{layer}.mlp.switch_mlp.{projection}.weight"


def _model(seed, dtype="bfloat16", **changes):
    from mlx_lm.models import qwen3_moe

    mx.random.seed(seed)
    config = {**TINY, **changes}
    model = qwen3_moe.Model(qwen3_moe.ModelArgs(**config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, config


def _save(model, config, directory):
    from mlx_lm.utils import save_config, save_model

    directory.mkdir(parents=True)
    save_model(directory, model)
    save_config(config, directory / "config.json")
    return directory


def _convert(model, config, directory, *, bits, group_size, quant_predicate=None):
    """What ``mlx_lm.convert -q`` writes: mlx-lm's own quantization of the model, saved."""
    from mlx_lm.utils import quantize_model

    model, config = quantize_model(model, dict(config), group_size, bits, quant_predicate=quant_predicate)
    return _save(model, config, directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny bfloat16 Qwen3-MoE saved as mlx-lm saves it, and its 2-bit conversion (groups of 64)."""
    root = tmp_path_factory.mktemp("served")
    model, config = _model(0)
    checkpoint = _save(model, config, root / "bf16")
    conversion = _convert(model, config, root / "2bit", bits=2, group_size=64)
    return checkpoint, conversion


def _store(checkpoint):
    from kq_host.expert_store import ExpertStore

    return ExpertStore(checkpoint, layout="stacked", template=FLOAT_TEMPLATE)


def test_a_tier_read_from_an_mlx_lm_conversion_is_the_tier_build_tier_makes(served, tmp_path):
    from kq_host.checkpoint import tier_from_checkpoint
    from kq_host.tier import build_tier

    checkpoint, conversion = served
    with _store(checkpoint) as store:
        read = tier_from_checkpoint(conversion, store, 2, 8)
        built = build_tier(store, 2, 8, bits=2, group_size=64, cache_dir=tmp_path / "cache")
    assert (read.bits, read.group_size, read.num_layers, read.num_experts) == (2, 64, 2, 8)
    assert sorted(read.weights) == sorted(built.weights) == ["down_proj", "gate_proj", "up_proj"]
    for name in built.weights:
        for field, a, b in zip(("packed", "scales", "biases"), read.weights[name], built.weights[name]):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, field)
            assert a.tobytes() == b.tobytes(), (name, field)
    assert read.weights["gate_proj"].scales.dtype == np.dtype(ml_dtypes.bfloat16)
    assert read.nbytes * 8 / (2 * 8 * 3 * 64 * 64) == 2.5


@pytest.mark.parametrize("changes, argument", [({"num_experts": 4}, "num_experts"),
                                               ({"num_hidden_layers": 3}, "num_layers"),
                                               ({"moe_intermediate_size": 32}, "gate_proj")])
def test_a_conversion_of_another_model_is_refused_by_name(served, tmp_path, changes, argument):
    from kq_host.checkpoint import tier_from_checkpoint

    model, config = _model(1, **changes)
    other = _convert(model, config, tmp_path / "other", bits=2, group_size=64)
    with _store(served[0]) as store:
        with pytest.raises(TierOptionError, match=argument):
            tier_from_checkpoint(other, store, 2, 8)


def test_a_float_checkpoint_or_float32_scales_or_mixed_options_are_refused_by_name(served, tmp_path):
    from kq_host.checkpoint import tier_from_checkpoint

    model, config = _model(0, dtype="float32")
    float32_scales = _convert(model, config, tmp_path / "f32", bits=2, group_size=64)
    model, config = _model(0)
    mixed = _convert(model, config, tmp_path / "mixed", bits=2, group_size=64,
                     quant_predicate=lambda path, module: {"bits": 4, "group_size": 64}
                     if path.startswith("model.layers.1.mlp.switch_mlp") else True)
    assert json.loads((mixed / "config.json").read_text())["quantization"]["model.layers.1.mlp.switch_mlp.up_proj"]
    model, config = _model(0)
    six_bits = _convert(model, config, tmp_path / "6bit", bits=6, group_size=64)
    with _store(served[0]) as store:
        with pytest.raises(TierOptionError, match="config.json.*quantization"):
            tier_from_checkpoint(served[0], store, 2, 8)
        with pytest.raises(TierOptionError, match="float32.*16-bit"):
            tier_from_checkpoint(float32_scales, store, 2, 8)
        with pytest.raises(TierOptionError, match="several"):
            tier_from_checkpoint(mixed, store, 2, 8)
        with pytest.raises(TierOptionError, match="config.json.*bits must be one of"):
            tier_from_checkpoint(six_bits, store, 2, 8)
        with pytest.raises(TierOptionError, match="num_layers"):
            tier_from_checkpoint(served[1], store, 3, 8)
        with pytest.raises(ExpertStoreError, match="config.json"):
            tier_from_checkpoint(tmp_path / "nowhere", store, 2, 8)
        with pytest.raises(ExpertStoreError, match="tier_from_checkpoint: directory must be a path, got None"):
            tier_from_checkpoint(None, store, 2, 8)


def test_tier_from_checkpoint_lives_in_kq_host_checkpoint_alone():
    """kq_host.tier imports nothing of kq_host.checkpoint (which builds on it): the function's former name is gone."""
    import kq_host.tier

    with pytest.raises(ImportError, match="tier_from_checkpoint"):
        from kq_host.tier import tier_from_checkpoint  # noqa: F401
    assert not hasattr(kq_host.tier, "tier_from_checkpoint")


@pytest.mark.parametrize("field, value", [("scales", float("nan")), ("biases", float("inf"))])
def test_a_conversion_of_non_finite_scales_or_biases_is_refused_naming_the_tensor(served, tmp_path, field, value):
    import shutil

    from kq_host.checkpoint import tier_from_checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(served[1], broken)
    (weights_file,) = broken.glob("model*.safetensors")
    arrays = mx.load(str(weights_file))
    name = f"model.layers.1.mlp.switch_mlp.up_proj.{field}"
    poisoned = np.array(arrays[name].astype(mx.float32))
    poisoned[3, 5, 0] = value
    arrays[name] = mx.array(poisoned).astype(arrays[name].dtype)
    mx.save_safetensors(str(weights_file), arrays)
    with _store(served[0]) as store:
        with pytest.raises(TierOptionError, match=rf"{name} holds a value that is not finite"):
            tier_from_checkpoint(broken, store, 2, 8)


def test_build_tier_takes_numpy_integer_options(served, tmp_path):
    from kq_host.tier import build_tier

    with _store(served[0]) as store:
        plain = build_tier(store, 2, 8, bits=2, group_size=64, cache_dir=tmp_path / "a")
        numpy_ints = build_tier(store, np.int64(2), np.int32(8), bits=np.int64(2), group_size=np.uint16(64),
                                cache_dir=tmp_path / "b")
        cached = build_tier(store, 2, 8, bits=np.int8(2), group_size=64, cache_dir=tmp_path / "b")
    for tier in (numpy_ints, cached):
        assert (tier.bits, tier.group_size) == (2, 64) and type(tier.bits) is int and type(tier.group_size) is int
        for name, weight in plain.weights.items():
            assert all(a.tobytes() == b.tobytes() for a, b in zip(weight, tier.weights[name]))


# ---- the tier in the mlx-lm adapter --------------------------------------------------------------


def _logits(model, prompt=(1, 2, 3, 4)):
    out = model(mx.array([list(prompt)]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def test_the_tier_read_from_a_conversion_serves_every_miss_as_the_converted_model_runs(tmp_path):
    """Nothing resident: every expert from the tier. The conversion quantized the experts only, so the model
    with the tier attached is the converted model, to the bit (both in float32, MLX's CPU gather_mm's dtype:
    the bfloat16 weights, scales and biases widened exactly)."""
    from kq_host.checkpoint import tier_from_checkpoint
    from kq_mlx.mlx_lm_adapter import attach_arena, attach_tier, set_tables

    model, config = _model(5)
    checkpoint = _save(model, config, tmp_path / "bf16")
    experts_only = _convert(model, config, tmp_path / "2bit", bits=2, group_size=64,
                            quant_predicate=lambda path, module: "switch_mlp" in path)
    model.set_dtype(mx.float32)  # quantize_model quantized `model` in place: the converted model
    assert type(model.layers[1].mlp.switch_mlp.down_proj).__name__ == "QuantizedSwitchLinear"
    assert type(model.layers[1].self_attn.q_proj).__name__ == "Linear"
    want = _logits(model)
    served, _ = _model(5)
    served.set_dtype(mx.float32)
    blocks = attach_arena(served, 2)
    set_tables(blocks, np.full((2, 8), -1, np.int32))
    with _store(checkpoint) as store:
        attach_tier(blocks, tier_from_checkpoint(experts_only, store, 2, 8))
    for block in blocks:
        block.rule = "tier"
    got = _logits(served)
    assert int(np.array(blocks[0].last[2].miss_ids).max()) >= 0
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


@pytest.mark.parametrize("options, argument", [({"bits": 4}, "bits"), ({"bits": 3}, "bits"),
                                               ({"group_size": 32}, "group_size"), ({"bits": 5}, "bits")])
def test_attach_tier_names_bits_or_group_size_that_disagree_with_the_arrays(served, options, argument):
    import dataclasses

    from kq_host.checkpoint import tier_from_checkpoint
    from kq_mlx.mlx_lm_adapter import attach_arena, attach_tier

    checkpoint, conversion = served
    with _store(checkpoint) as store:
        tier = tier_from_checkpoint(conversion, store, 2, 8)
    model, _ = _model(0)
    blocks = attach_arena(model, 2)
    with pytest.raises(ValueError, match=argument):
        attach_tier(blocks, dataclasses.replace(tier, **options))
    assert all(block.tier is None for block in blocks)
