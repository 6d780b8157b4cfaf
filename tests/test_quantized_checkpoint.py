"""Checkpoints stored quantized in mlx-community's layout, read as float: the whole model and one expert."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kq_host.expert_store import ExpertStore, ExpertStoreError
from kq_host.checkpoint import DequantizedExperts, Quantization, dense_tensors, open_experts, tier_from_checkpoint
from kq_host.tier import build_tier, dequantize, quantize

SHIPPED_4BIT = Path(__file__).resolve().parents[1] / "models" / "wheels-moe"


def _write(path, rng, *, layers=2, experts=4, hidden=64, ffn=64, router_bits=8, mode=None, **config):
    """A small quantized checkpoint: stacked experts at 4 bits, a router at ``router_bits``, a float norm;
    ``config`` goes into ``config.json`` beside ``model_type`` and ``quantization``."""
    from safetensors.numpy import save_file

    path.mkdir()
    tensors, floats = {}, {}
    for layer in range(layers):
        for projection, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)),
                                  ("down_proj", (hidden, ffn))):
            weight = rng.standard_normal((experts, *shape)).astype(ml_dtypes.bfloat16)
            floats[(layer, projection)] = weight
            q = quantize(weight, bits=4, group_size=64)
            for field, array in zip(("weight", "scales", "biases"), q):
                tensors[f"model.layers.{layer}.mlp.switch_mlp.{projection}.{field}"] = array
        router = quantize(rng.standard_normal((experts, hidden)).astype(ml_dtypes.bfloat16), bits=router_bits,
                          group_size=64)
        floats[(layer, "router")] = router
        for field, array in zip(("weight", "scales", "biases"), router):
            tensors[f"model.layers.{layer}.mlp.gate.{field}"] = array
    tensors["model.norm.weight"] = rng.standard_normal(hidden).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    quantization = {"group_size": 64, "bits": 4, **({"mode": mode} if mode else {}),
                    **{f"model.layers.{l}.mlp.gate": {"group_size": 64, "bits": router_bits} for l in range(layers)}}
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization": quantization, **config}))
    return floats, tensors


def _retype(path, name, dtype):
    """Rewrites the header of ``path``'s tensor ``name`` to say ``dtype`` (one of the same width)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    header[name]["dtype"] = dtype
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def test_a_float_checkpoint_has_no_quantization(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert Quantization.of(tmp_path) is None


def test_dense_tensors_dequantize_each_module_with_its_own_options(tmp_path, rng):
    floats, _ = _write(tmp_path / "ckpt", rng)
    quantization = Quantization.of(tmp_path / "ckpt")
    assert quantization.options("model.layers.1.mlp.gate") == (8, 64)
    assert quantization.options("model.layers.1.mlp.switch_mlp.up_proj") == (4, 64)
    dense = dense_tensors(tmp_path / "ckpt", quantization)
    assert not [n for n in dense if n.endswith((".scales", ".biases"))]
    want = dequantize(floats[(1, "router")], bits=8, group_size=64)
    np.testing.assert_array_equal(dense["model.layers.1.mlp.gate.weight"].view(np.uint32), want.view(np.uint32))
    gate = dense["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    assert gate.dtype == np.float32 and gate.shape == (4, 64, 64)
    # 4 bits of a unit normal: within half a step of the stored bf16 weight
    error = np.abs(gate - floats[(0, "gate_proj")].astype(np.float32))
    assert 0 < error.max() < 0.5


def test_one_expert_reads_its_packed_bytes_and_hands_out_float(tmp_path, rng):
    floats, tensors = _write(tmp_path / "ckpt", rng)
    with open_experts(tmp_path / "ckpt") as store:
        assert isinstance(store, DequantizedExperts)
        assert store.expert_shapes(1) == {p: (s, np.dtype(np.float32)) for p, s in
                                          (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64)))}
        packed_bytes = sum(tensors[f"model.layers.1.mlp.switch_mlp.{p}.{f}"][2].nbytes
                           for p in ("gate_proj", "up_proj", "down_proj") for f in ("weight", "scales", "biases"))
        assert store.expert_nbytes(1) == packed_bytes
        read = store.submit(1, 2).result()
        assert store.bytes_read == packed_bytes
        dense = dense_tensors(tmp_path / "ckpt", store.quantization)
        for projection, array in read.items():
            want = dense[f"model.layers.1.mlp.switch_mlp.{projection}.weight"][2]
            np.testing.assert_array_equal(array.view(np.uint32), want.view(np.uint32))


def test_the_stored_arrays_come_as_they_are_for_a_quantized_arena(tmp_path, rng):
    _, tensors = _write(tmp_path / "ckpt", rng)
    with open_experts(tmp_path / "ckpt", dequantized=False) as store:
        assert isinstance(store, ExpertStore)
        read = store.read_expert(0, 3)
    assert sorted(read) == sorted(f"{p}.{f}" for p in ("gate_proj", "up_proj", "down_proj")
                                  for f in ("weight", "scales", "biases"))
    np.testing.assert_array_equal(read["down_proj.scales"].view(np.uint16),
                                  tensors["model.layers.0.mlp.switch_mlp.down_proj.scales"][3].view(np.uint16))


def test_a_tier_of_a_quantized_checkpoint_is_built_from_its_dequantized_experts(tmp_path, rng):
    _write(tmp_path / "ckpt", rng)
    with open_experts(tmp_path / "ckpt") as store:
        tier = build_tier(store, 2, 4, bits=2, group_size=32, cache_dir=tmp_path / "cache")
        want = quantize(store.read_expert(1, 3)["up_proj"], bits=2, group_size=32)
    np.testing.assert_array_equal(tier.layer(1)["up_proj"].packed[3], want.packed)


@pytest.mark.parametrize("mode, message", [("mxfp4", "affine mode only")])
def test_other_quantization_modes_are_refused_by_name(tmp_path, rng, mode, message):
    _write(tmp_path / "ckpt", rng, mode=mode)
    with pytest.raises(ExpertStoreError, match=message):
        open_experts(tmp_path / "ckpt")


@pytest.mark.skipif(not SHIPPED_4BIT.is_dir(), reason="the 16-layer checkpoint is not in this tree")
def test_the_jax_model_reads_the_shipped_4bit_checkpoint_as_mlx_lm_computes_it(rng):
    """The 16-layer model in JAX, from its 4-bit files, against mlx-lm's own forward on the same files."""
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import jax.numpy as jnp

    from kq_jax import qwen3_moe

    cfg = qwen3_moe.Qwen3MoeConfig.load(SHIPPED_4BIT)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (16, 64, 8, False)
    tokens = rng.integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    jax_logits = np.asarray(qwen3_moe.forward(qwen3_moe.load_params(SHIPPED_4BIT, cfg), jnp.asarray(tokens), cfg)[0])
    model, _ = mlx_lm.load(str(SHIPPED_4BIT))
    model.set_dtype(mx.float32)
    mlx_logits = np.array(model(mx.array(tokens)))
    assert np.abs(jax_logits - mlx_logits).max() < 1e-3
    assert (jax_logits.argmax(-1) == mlx_logits.argmax(-1)).all()


@pytest.mark.parametrize("quantization, message", [
    (4, "must be a JSON object"), ({"bits": 2.9, "group_size": 64}, "bits must be an int in \\[1, 8\\]"),
    ({"bits": True, "group_size": 64}, "bits"), ({"bits": 0, "group_size": 64}, "bits"),
    ({"bits": 4, "group_size": 0}, "group_size must be an int >= 1"),
    ({"bits": 4, "group_size": 64, "model.layers.0.mlp.gate": {"bits": 4}}, "model.layers.0.mlp.gate.*group_size"),
], ids=["not-an-object", "float-bits", "bool-bits", "zero-bits", "zero-group", "module-without-group"])
def test_quantization_options_that_are_no_options_are_refused_by_name(tmp_path, quantization, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization": quantization}))
    with pytest.raises(ExpertStoreError, match=message):
        Quantization.of(tmp_path)


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"], ids=["list", "bad-json"])
def test_a_config_that_is_no_json_object_is_named(tmp_path, text):
    from kq_host.checkpoint import CheckpointError

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        Quantization.of(tmp_path)


def test_a_dequantizing_store_refuses_a_read_after_close_as_the_store_does(tmp_path, rng):
    from kq_host.expert_store import ExpertStoreClosed

    _write(tmp_path / "ckpt", rng)
    store = open_experts(tmp_path / "ckpt")
    assert isinstance(store, DequantizedExperts)
    assert set(store.submit(0, 1).result()) == {"gate_proj", "up_proj", "down_proj"}
    store.close()
    with pytest.raises(ExpertStoreClosed):
        store.submit(0, 1)


def test_whole_numbers_written_as_floats_are_options(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"bits": 4.0, "group_size": 64.0,
                                                                       "model.embed": False}}))
    quantization = Quantization.of(tmp_path)
    assert (quantization.bits, quantization.group_size, quantization.modules) == (4, 64, {})


@pytest.mark.parametrize("dequantized", [True, False], ids=["dequantized", "packed"])
@pytest.mark.parametrize("dtype", ["F32", "I32"], ids=["float32-weight", "int32-weight"])
def test_a_packed_weight_that_is_no_uint32_is_refused_at_open_by_file_and_tensor(tmp_path, rng, dtype, dequantized):
    _write(tmp_path / "ckpt", rng)
    _retype(tmp_path / "ckpt" / "model.safetensors", "model.layers.1.mlp.switch_mlp.gate_proj.weight", dtype)
    with pytest.raises(ExpertStoreError, match=r"model\.safetensors: model\.layers\.1\.mlp\.switch_mlp\.gate_proj"
                                               r"\.weight is .*, not packed uint32 words"):
        open_experts(tmp_path / "ckpt", dequantized=dequantized)


@pytest.mark.parametrize("options", [{"bits": 8, "group_size": 64}, {"bits": 3, "group_size": 64},
                                     {"bits": 4, "group_size": 32}],
                         ids=["8-bits-of-4-bit-words", "3-bits-of-4-bit-words", "groups-of-32-of-64"])
def test_packed_shapes_that_disagree_with_the_options_are_refused_by_file_and_tensor(tmp_path, rng, options):
    _write(tmp_path / "ckpt", rng)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization"].update(options)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertStoreError, match=r"model\.safetensors: model\.layers\.0\.mlp\.switch_mlp\.gate_proj"
                                               rf"\.weight .* bits={options['bits']}, group_size={options['group_size']}"):
        open_experts(tmp_path / "ckpt")


@pytest.mark.parametrize("dequantized", [True, False], ids=["dequantized", "packed"])
def test_options_that_unpack_to_another_width_than_the_config_says_are_refused(tmp_path, rng, dequantized):
    """4-bit words read at 2 bits in groups of 128: packed shapes that agree, a width twice the model's."""
    _write(tmp_path / "ckpt", rng, hidden_size=64, moe_intermediate_size=64)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization"].update(bits=2, group_size=128)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertStoreError, match=r"model\.safetensors: model\.layers\.0\.mlp\.switch_mlp\.gate_proj"
                                               r"\.weight .*\[64, 128\].*gate_proj \[64, 64\]"):
        open_experts(tmp_path / "ckpt", dequantized=dequantized)


def test_a_config_that_gives_the_widths_opens_when_the_experts_agree(tmp_path, rng):
    _write(tmp_path / "ckpt", rng, hidden=64, ffn=128, hidden_size=64, moe_intermediate_size=128)
    with open_experts(tmp_path / "ckpt") as store:
        assert {p: s for p, (s, _) in store.expert_shapes(0).items()} == {
            "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}


def _second_copy(directory, name):
    """The checkpoint in two shards, the second holding another copy (zeros) of the tensor ``name``."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    save_file({name: np.zeros_like(tensors[name])}, str(directory / "model-00002-of-00002.safetensors"))


READERS = {
    "tier_from_checkpoint": lambda directory, store: tier_from_checkpoint(directory, store, 2, 4),
    "dense_tensors": lambda directory, store: dense_tensors(directory, Quantization.of(directory)),
    "open_experts": lambda directory, store: open_experts(directory),
    "open_experts-packed": lambda directory, store: open_experts(directory, dequantized=False),
}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_a_tensor_in_two_shards_is_refused_naming_both_files(tmp_path, rng, read):
    _write(tmp_path / "ckpt", rng)
    _write(tmp_path / "shards", rng)
    name = "model.layers.1.mlp.switch_mlp.up_proj.scales"
    _second_copy(tmp_path / "shards", name)
    with open_experts(tmp_path / "ckpt") as store:
        read(tmp_path / "ckpt", store)  # the checkpoint in one file is read
        with pytest.raises(ExpertStoreError, match=rf"tensor {name} is in \S*model-00001-of-00002\.safetensors "
                                                   rf"and in \S*model-00002-of-00002\.safetensors"):
            read(tmp_path / "shards", store)
