"""The mlx-lm adapter: tiny Qwen3-MoE and Mixtral models (random weights, from a config, no network)."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models import mixtral, qwen3_moe  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, set_tables  # noqa: E402

EXPERTS, LAYERS = 16, 2


def qwen3_model():
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=128,
        num_attention_heads=4, num_experts=EXPERTS, num_experts_per_tok=4, decoder_sparse_step=1,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=2,
        head_dim=16, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512,
        norm_topk_prob=True)
    return qwen3_moe.Model(args)


def mixtral_model():
    args = mixtral.ModelArgs(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
                             num_hidden_layers=LAYERS, num_attention_heads=4, num_experts_per_tok=2,
                             num_key_value_heads=2, num_local_experts=EXPERTS)
    return mixtral.Model(args)


def greedy(model, prompt, steps, after_step=None):
    """Greedy decoding; returns (tokens, last-position logits per step)."""
    cache = make_prompt_cache(model)
    tokens, logits_seen, x = list(prompt), [], mx.array([prompt])
    for _ in range(steps):
        logits = model(x, cache=cache)[0, -1]
        mx.eval(logits)
        logits_seen.append(np.array(logits))
        if after_step is not None:
            after_step()
        tokens.append(int(mx.argmax(logits).item()))
        x = mx.array([[tokens[-1]]])
    return tokens, logits_seen


@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
def test_every_expert_resident_reproduces_the_model_bit_for_bit(make_model):
    mx.random.seed(0)
    model = make_model()
    mx.eval(model.parameters())
    want_tokens, want_logits = greedy(model, [1, 2, 3], 10)

    blocks = attach_arena(model, EXPERTS)
    arena = SwitchGLUArena(blocks)
    rng = np.random.default_rng(0)
    tables = np.empty((LAYERS, EXPERTS), np.int32)
    for layer, block in enumerate(blocks):
        slots = rng.permutation(EXPERTS)  # slots deliberately not equal to expert ids
        tables[layer, np.arange(EXPERTS)] = slots
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(slots[expert]), block.expert_weights(expert))
    set_tables(blocks, tables)
    got_tokens, got_logits = greedy(model, [1, 2, 3], 10)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_array_equal(want.view(np.uint32), got.view(np.uint32))


def test_partial_arena_runs_with_the_residency_manager():
    mx.random.seed(1)
    model = qwen3_model()
    mx.eval(model.parameters())
    blocks = attach_arena(model, num_slots=6)
    manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=lambda l, e, s: blocks[l].expert_weights(e),
                               arena=SwitchGLUArena(blocks), queue_depth=2, read_budget=8)
    set_tables(blocks, manager.snapshot())

    def boundary():
        set_tables(blocks, manager.step([block.report() for block in blocks]))

    tokens, logits = greedy(model, [5, 6, 7, 8], 16, after_step=boundary)
    manager.drain()
    _, total = manager.stats()
    assert len(tokens) == 20 and all(np.isfinite(step).all() for step in logits)
    assert total.hits > 0 and total.misses > 0 and total.reads_landed > 0
    assert total.lookups == total.hits + total.misses
    assert all(len(manager.resident(layer)) <= 6 for layer in range(LAYERS))
    manager.close()


QUANTIZATIONS = [dict(group_size=32, bits=4), dict(group_size=32, bits=8)]


def _fill_every_expert(blocks, arena, load):
    """Every expert resident, in slots deliberately not equal to the expert ids; returns the tables."""
    rng = np.random.default_rng(0)
    tables = np.empty((LAYERS, EXPERTS), np.int32)
    for layer in range(len(blocks)):
        slots = rng.permutation(EXPERTS)
        tables[layer, np.arange(EXPERTS)] = slots
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(slots[expert]), load(layer, expert))
    set_tables(blocks, tables)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=["4bit", "8bit"])
@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
def test_quantized_experts_resident_reproduce_the_quantized_model(make_model, quantization):
    import mlx.nn as nn

    mx.random.seed(0)
    model = make_model()
    nn.quantize(model, **quantization)
    mx.eval(model.parameters())
    want_tokens, want_logits = greedy(model, [1, 2, 3], 10)

    blocks = attach_arena(model, EXPERTS)
    layout = blocks[0].slot_layout()
    assert sorted(layout) == sorted(f"{p}.{a}" for p in ("gate_proj", "up_proj", "down_proj")
                                    for a in ("weight", "scales", "biases"))
    assert layout["gate_proj.weight"][1] == np.uint32
    assert type(blocks[0].arena.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert blocks[0].arena.gate_proj.bits == quantization["bits"]
    _fill_every_expert(blocks, SwitchGLUArena(blocks), lambda layer, expert: blocks[layer].expert_weights(expert))
    got_tokens, got_logits = greedy(model, [1, 2, 3], 10)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_array_equal(want.view(np.uint32), got.view(np.uint32))


def test_quantized_experts_stream_from_an_mlx_community_checkpoint(tmp_path):
    """Packed weights, scales and biases read by ExpertStore from the stacked switch_mlp tensors of a file."""
    import mlx.nn as nn

    from kq_host.expert_store import ExpertStore

    mx.random.seed(2)
    model = qwen3_model()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    want_tokens, want_logits = greedy(model, [4, 5], 8)
    tensors = {f"model.layers.{i}.mlp.switch_mlp.{key}": array
               for i, layer in enumerate(model.layers) for key, array in
               [(f"{p}.{a}", getattr(layer.mlp.switch_mlp, p)[a]) for p in ("gate_proj", "up_proj", "down_proj")
                for a in ("weight", "scales", "biases")]}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)

    blocks = attach_arena(model, EXPERTS)
    store = ExpertStore(tmp_path, layout="stacked", template="model.layers.{layer}.mlp.switch_mlp.{projection}",
                        projections=tuple(blocks[0].slot_layout()))
    _fill_every_expert(blocks, SwitchGLUArena(blocks), store.read_expert)
    got_tokens, got_logits = greedy(model, [4, 5], 8)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_array_equal(want.view(np.uint32), got.view(np.uint32))
