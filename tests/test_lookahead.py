"""Look-ahead predictions in the JAX model, and the replay of an exact loop that prefetches them."""

import numpy as np
import pytest

from kq.replay import recall, simulate


def _trace(seed=0, tokens=40, layers=3, experts=16, top_k=4):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(experts)[:top_k] for _ in range(layers)] for _ in range(tokens)]).astype(np.int32)


def _perfect(indices, depth=2):
    """Predictions that name exactly what the next layers route."""
    tokens, layers, top_k = indices.shape
    out = np.full((tokens, layers, depth, top_k), -1, np.int32)
    for layer in range(layers):
        for ahead in range(1, depth + 1):
            if layer + ahead < layers:
                out[:, layer, ahead - 1] = indices[:, layer + ahead]
    return out


def test_lru_without_look_ahead_counts_by_hand():
    # one layer, 2 slots, top-2: tokens route {0,1}, {0,1}, {2,3}, {0,1}
    indices = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[0, 1]]], np.int32)
    replay = simulate(indices, None, slots=2, policy="lru")
    assert (replay.lookups, replay.hits, replay.critical_reads) == (8, 2, 6)
    replay = simulate(indices, None, slots=4, policy="lfu", warmup=1)
    assert (replay.lookups, replay.hits, replay.critical_reads) == (6, 4, 2)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_perfect_predictions_leave_only_the_first_layers_misses(policy):
    indices = _trace()
    without = simulate(indices, None, slots=8, policy=policy)
    with_ahead = simulate(indices, _perfect(indices), slots=8, policy=policy, lookahead=1)
    # layers 1 and 2 never miss: each prediction was read while the layer before ran
    first_layer_misses = simulate(indices[:, :1], None, slots=8, policy=policy).critical_reads
    assert with_ahead.critical_reads == first_layer_misses < without.critical_reads
    assert with_ahead.wasted_prefetches == 0 and with_ahead.useful_prefetches == with_ahead.prefetches > 0
    assert np.allclose(recall(indices, _perfect(indices))[:2, 0], 1.0)


def test_a_read_budget_caps_the_prefetches_and_wrong_predictions_are_wasted():
    indices = _trace(seed=1)
    wrong = _perfect(_trace(seed=2))
    capped = simulate(indices, wrong, slots=8, policy="lru", lookahead=2, budget=1)
    free = simulate(indices, wrong, slots=8, policy="lru", lookahead=2)
    assert capped.prefetches <= indices.shape[0] * 3 and capped.prefetches < free.prefetches
    assert free.wasted_prefetches > free.useful_prefetches


def test_bad_arguments_are_named():
    indices = _trace()
    with pytest.raises(ValueError, match="policy"):
        simulate(indices, None, slots=8, policy="fifo")
    with pytest.raises(ValueError, match="slots"):
        simulate(indices, None, slots=2)
    with pytest.raises(ValueError, match="lookahead"):
        simulate(indices, None, slots=8, lookahead=1)


def test_the_models_look_ahead_leaves_its_output_alone():
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    import jax.numpy as jnp

    from kq.study import StudyConfig
    from kq.study_jax import JaxStudy
    from kq_jax import qwen3_moe
    from kq_jax.moe import Experts, experts_apply

    study = JaxStudy(StudyConfig(tokens=4, warmup=1))
    cfg, params = study.cfg, study.full_params()

    def moe(layer, p, x):
        indices, scores, _ = qwen3_moe.route_layer(p, x, cfg)
        y = experts_apply(x, Experts(p["gate_proj"], p["up_proj"], p["down_proj"]), indices)
        return jnp.einsum("tkd,tk->td", y, scores), indices

    token = jnp.asarray(study.tokens[:1])
    plain = qwen3_moe.decode_step(params, token, 0, qwen3_moe.empty_cache(cfg, 1, 4), cfg, moe)
    ahead = qwen3_moe.decode_step(params, token, 0, qwen3_moe.empty_cache(cfg, 1, 4), cfg, moe, lookahead=2)
    assert np.array_equal(np.asarray(plain[0]).view(np.uint32), np.asarray(ahead[0]).view(np.uint32))
    ids, scores = ahead[3]
    layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    assert ids.shape == (layers, 2, 1, k) and scores.shape == ids.shape
    assert (np.asarray(ids)[-1] == -1).all() and (np.asarray(ids)[-2, 1] == -1).all()
    assert ((np.asarray(ids)[0] >= 0) & (np.asarray(ids)[0] < cfg.num_experts)).all()


@pytest.mark.parametrize("lookahead", [-1, 1.5, True], ids=["negative", "float", "bool"])
def test_a_look_ahead_the_step_cannot_take_is_refused_by_name(lookahead):
    pytest.importorskip("jax")
    from kq_jax import qwen3_moe

    cfg = qwen3_moe.Qwen3MoeConfig(vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
                                   num_key_value_heads=1, head_dim=4, num_experts=2, num_experts_per_tok=1,
                                   moe_intermediate_size=4)
    with pytest.raises(ValueError, match="lookahead"):
        qwen3_moe.decode_step({}, np.zeros(1, np.int32), 0, qwen3_moe.empty_cache(cfg, 1, 2), cfg, None,
                              lookahead=lookahead)
