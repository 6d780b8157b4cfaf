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
