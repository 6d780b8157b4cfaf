"""Qwen3-MoE on the NNX module: kq_jax.qwen3_moe_nnx.Qwen3MoeDecoder against the functional decode step
(kq_jax.qwen3_moe_arena.make_step) on the shipped checkpoint, logits and reports bit for bit."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

from kq.study import SHIPPED_MODEL  # noqa: E402
from kq_core.reports import REPORT_FIELDS  # noqa: E402
from kq_core.rules import DEFAULT_RULE  # noqa: E402
from kq_host.residency import LayerReport, ResidencyManager  # noqa: E402
from kq_host.tier import quantize  # noqa: E402
from kq_jax import qwen3_moe  # noqa: E402
from kq_jax.arena import JaxArena  # noqa: E402
from kq_jax.moe import tier_experts  # noqa: E402
from kq_jax.nnx import ArenaMoE, DenseMoE  # noqa: E402
from kq_jax.qwen3_moe_arena import make_step  # noqa: E402
from kq_jax.qwen3_moe_nnx import Qwen3MoeDecoder  # noqa: E402

TOKENS = [17, 402, 1033, 9, 77, 2048]  # a fixed prompt, decoded one token a step
SLOTS = 16  # a quarter of the shipped model's 64 experts a layer


@pytest.fixture(scope="module")
def model():
    cfg = qwen3_moe.Qwen3MoeConfig.load(SHIPPED_MODEL)
    return cfg, qwen3_moe.load_params(SHIPPED_MODEL, cfg)


def bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint32)


def _stacked(params, name) -> np.ndarray:
    return np.stack([np.asarray(layer[name]) for layer in params["layers"]])  # [L, E, ...]


def _placed(params, cfg, num_slots: int, seed: int = 0):
    """Tables [L, E] and an arena {projection: [L, S, ...]} of ``num_slots`` experts a layer, placed at random."""
    rng = np.random.default_rng(seed)
    tables = np.full((cfg.num_hidden_layers, cfg.num_experts), -1, np.int32)
    arena = {name: np.zeros((cfg.num_hidden_layers, num_slots, *w.shape[2:]), w.dtype)
             for name, w in ((name, _stacked(params, name)) for name in qwen3_moe.PROJECTIONS)}
    for layer in range(cfg.num_hidden_layers):
        ids = rng.permutation(cfg.num_experts)[:num_slots]
        tables[layer, ids] = np.arange(num_slots)
        for name in qwen3_moe.PROJECTIONS:
            arena[name][layer] = np.asarray(params["layers"][layer][name])[ids]
    return jnp.asarray(tables), {name: jnp.asarray(a) for name, a in arena.items()}


def _tier(params, bits_=3, group_size=32):
    """The tier of every expert, ``{projection: (packed, scales, biases)}`` ``[L, E, ...]`` (make_step's)."""
    return {name: tuple(jnp.asarray(a) for a in quantize(_stacked(params, name), bits=bits_, group_size=group_size))
            for name in qwen3_moe.PROJECTIONS}


_decode = nnx.jit(lambda decoder, token, position, cache: decoder(token, position, cache))


def _run_both(cfg, params, decoder, functional, arena, tables, tier=None):
    """Both steps over TOKENS on their own caches; per token, the logits and the packed reports of each."""
    cache_f = cache_n = qwen3_moe.empty_cache(cfg, 1, len(TOKENS))
    extra = () if tier is None else (tier,)
    steps = []
    for position, token in enumerate(TOKENS):
        token = jnp.array([token], jnp.int32)
        want, cache_f, want_reports = functional(params, arena, tables, token, position, cache_f, *extra)
        got, cache_n, reports = _decode(decoder, token, position, cache_n)
        steps.append((want, want_reports, got, reports))
    return steps


def _assert_same(steps):
    for want, want_reports, got, reports in steps:
        assert np.abs(np.asarray(want)).max() > 0
        np.testing.assert_array_equal(bits(want), bits(got))
        np.testing.assert_array_equal(np.asarray(want_reports), np.asarray(reports))


def _misses(steps) -> int:
    return sum(int((np.asarray(reports)[REPORT_FIELDS.index("miss_ids")] >= 0).sum()) for *_, reports in steps)


def test_every_expert_resident_gives_the_functional_and_the_resident_steps_logits(model):
    cfg, params = model
    tables, arena = _placed(params, cfg, cfg.num_experts)
    decoder = Qwen3MoeDecoder(params, cfg, cfg.num_experts, rule="route_shed")
    decoder.set_residency(tables, arena)
    steps = _run_both(cfg, params, decoder, make_step(cfg, "route_shed"), arena, tables)
    _assert_same(steps)
    assert _misses(steps) == 0
    resident = _run_both(cfg, params, decoder, make_step(cfg, "stall"), None, tables)
    for (want, *_), (_, _, got, _) in zip(resident, steps):
        np.testing.assert_array_equal(bits(want), bits(got))


@pytest.mark.parametrize("rule", ["route_shed", "shed"])
def test_a_quarter_arena_shedding_is_the_functional_step_of_its_rule(model, rule):
    cfg, params = model
    tables, arena = _placed(params, cfg, SLOTS)
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS, rule=rule)
    decoder.set_residency(tables, arena)
    steps = _run_both(cfg, params, decoder, make_step(cfg, rule), arena, tables)
    _assert_same(steps)
    assert _misses(steps) > 0
    resident = _run_both(cfg, params, decoder, make_step(cfg, "stall"), None, tables)
    assert not np.array_equal(bits(resident[-1][0]), bits(steps[-1][2]))  # the sheds changed the logits


def test_a_quarter_arena_with_a_tier_is_the_functional_tier_step(model):
    cfg, params = model
    tables, arena = _placed(params, cfg, SLOTS, seed=1)
    tier = _tier(params)
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS, rule="tier", tier_bits=3, tier_group_size=32)
    decoder.set_residency(tables, arena)
    decoder.set_tier(tier_experts(tier, bits=3, group_size=32))
    steps = _run_both(cfg, params, decoder, make_step(cfg, "tier", (3, 32)), arena, tables, tier)
    _assert_same(steps)
    assert _misses(steps) > 0


class _StackedStore:
    """The checkpoint's experts held in memory, read as an ExpertStore reads them."""

    def __init__(self, params):
        self.host = {name: _stacked(params, name) for name in qwen3_moe.PROJECTIONS}

    def read_expert(self, layer, expert):
        return {name: w[layer, expert] for name, w in self.host.items()}


def test_a_quarter_arena_fetching_its_misses_gives_the_resident_logits_in_one_pass(model):
    """rule='exact': each token one pass, its misses read inside the step by a MissReader, which then hands
    them to the manager; the logits are the resident model's bit for bit, from a cold arena on."""
    from kq_host.miss_reader import MissReader

    cfg, params = model
    store = _StackedStore(params)
    reader = MissReader(store, qwen3_moe.PROJECTIONS, workers=2)
    arena = JaxArena(cfg.num_hidden_layers, SLOTS, {name: (w.shape[2:], w.dtype) for name, w in store.host.items()})
    manager = ResidencyManager(cfg.num_hidden_layers, cfg.num_experts, SLOTS, arena=arena, loader=
                               lambda layer, expert, slot: reader.loader(layer, expert))
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS, rule="exact", fetch=reader)
    resident = make_step(cfg, "stall")
    cache_r = cache_n = qwen3_moe.empty_cache(cfg, 1, len(TOKENS))
    tables, misses = manager.snapshot(), 0
    try:
        for position, token in enumerate(TOKENS):
            token = jnp.array([token], jnp.int32)
            decoder.set_residency(tables, arena.arrays)
            want, cache_r, _ = resident(params, None, jnp.asarray(tables), token, position, cache_r)
            got, cache_n, reports = _decode(decoder, token, position, cache_n)
            np.testing.assert_array_equal(bits(want), bits(got))
            misses += int((np.asarray(reports)[REPORT_FIELDS.index("miss_ids")] >= 0).sum())
            manager.step(LayerReport.from_packed(np.asarray(reports)))
            manager.drain()
            tables = manager.snapshot()
    finally:
        manager.close()
        reader.close()
    assert misses > 0 and reader.experts_read > 0 and manager.stats()[1].hits > 0


@pytest.mark.parametrize("options", [{"rule": "exact"}, {"rule": "shed", "fetch": lambda layer, ids: ()}],
                         ids=["exact-without-reader", "reader-without-exact"])
def test_a_reader_goes_with_rule_exact(model, options):
    cfg, params = model
    with pytest.raises(ValueError, match="fetch"):
        Qwen3MoeDecoder(params, cfg, SLOTS, **options)


def test_the_decoder_steps_with_the_manager_and_a_jax_arena(model):
    """The host between tokens: the manager's tables and the JaxArena's arrays handed to the decoder as they
    are; the functional step on the same tables and arena gives the same bits, and the reads land."""
    cfg, params = model
    host = {name: _stacked(params, name) for name in qwen3_moe.PROJECTIONS}
    arena = JaxArena(cfg.num_hidden_layers, SLOTS, {name: (w.shape[2:], w.dtype) for name, w in host.items()})
    manager = ResidencyManager(cfg.num_hidden_layers, cfg.num_experts, SLOTS, arena=arena, queue_depth=0,
                               loader=lambda layer, expert, slot: {n: w[layer, expert] for n, w in host.items()})
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS)  # kq_core.rules.DEFAULT_RULE
    functional = make_step(cfg, DEFAULT_RULE)
    cache_f = cache_n = qwen3_moe.empty_cache(cfg, 1, len(TOKENS))
    tables, misses = manager.snapshot(), []
    try:
        for position, token in enumerate(TOKENS):
            token = jnp.array([token], jnp.int32)
            decoder.set_residency(tables, arena.arrays)
            want, cache_f, want_reports = functional(params, arena.arrays, jnp.asarray(tables), token, position,
                                                     cache_f)
            got, cache_n, reports = _decode(decoder, token, position, cache_n)
            np.testing.assert_array_equal(bits(want), bits(got))
            np.testing.assert_array_equal(np.asarray(want_reports), np.asarray(reports))
            misses.append(int((np.asarray(reports)[REPORT_FIELDS.index("miss_ids")] >= 0).sum()))
            tables = manager.step(LayerReport.from_packed(np.asarray(reports)))
    finally:
        manager.close()
    assert misses[0] == cfg.num_hidden_layers * cfg.num_experts_per_tok  # a cold arena: every entry missed
    assert manager.stats()[1].hits > 0


def test_one_checkpoint_layer_as_the_dense_and_the_arena_module(model):
    cfg, params = model
    layer = params["layers"][1]
    x = jax.random.normal(jax.random.key(3), (5, cfg.hidden_size), jnp.float32)
    want = jax.jit(lambda p, x: qwen3_moe.moe_resident(p, x, cfg))(layer, x)
    dense = DenseMoE.from_qwen3_moe(layer, cfg)
    assert not dense.router.normalize  # the shipped model keeps its top-k scores as they are
    got = nnx.jit(lambda module, x: module(x))(dense, x)
    np.testing.assert_array_equal(bits(want), bits(got))
    every, _ = nnx.jit(lambda module, x: module(x))(ArenaMoE.from_dense(dense), x)
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(bits(want), bits(every))


@pytest.mark.parametrize("change, argument", [
    (lambda params, cfg: (params, {"hidden_size": 8}, 4), "cfg"),
    (lambda params, cfg: (params, cfg, 0), "num_slots"),
    (lambda params, cfg: ({"embed": params["embed"]}, cfg, 4), "params"),
    (lambda params, cfg: ({**params, "layers": params["layers"][:2]}, cfg, 4), "layers"),
    (lambda params, cfg: ({**params, "embed": params["embed"][:, :8]}, cfg, 4), "embed"),
    (lambda params, cfg: ({**params, "layers": [{**layer, "router": layer["router"][:8]}
                                                for layer in params["layers"]]}, cfg, 4), "router"),
])
def test_a_decoder_it_cannot_build_is_refused_by_name(model, change, argument):
    cfg, params = model
    with pytest.raises(ValueError, match=argument):
        Qwen3MoeDecoder(*change(params, cfg))


def test_a_layer_of_another_shape_is_refused_by_name(model):
    cfg, params = model
    layer = params["layers"][0]
    for bad, argument in (({k: v for k, v in layer.items() if k != "up_proj"}, "up_proj"),
                          ({**layer, "down_proj": layer["down_proj"][:, :, :8]}, "down_proj"),
                          ({**layer, "gate_proj": layer["gate_proj"].astype(jnp.bfloat16)}, "gate_proj"),
                          ([layer["router"]], "layer")):
        with pytest.raises(ValueError, match=argument):
            DenseMoE.from_qwen3_moe(bad, cfg)


def test_a_step_it_cannot_take_is_refused_by_name(model):
    cfg, params = model
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS)
    cache = qwen3_moe.empty_cache(cfg, 1, 4)
    for tokens, bad_cache, argument in ((jnp.array([[3]], jnp.int32), cache, "tokens"),
                                        (jnp.array([3.0]), cache, "tokens"),
                                        (jnp.array([3, 4], jnp.int32), cache, "cache"),
                                        (jnp.array([3], jnp.int32), cache[0], "cache"),
                                        (jnp.array([3], jnp.int32), (cache[0], cache[1][:, :, :2]),
                                         "cache's keys and values must have one length")):
        with pytest.raises(ValueError, match=argument):
            _decode(decoder, tokens, 0, bad_cache)


@pytest.mark.parametrize("tokens, position, cache_dtype, argument", [
    ([5], 4, jnp.float32, "position must lie in \\[0, 4\\)"), ([5], -1, jnp.float32, "position"),
    ("vocab", 0, jnp.float32, "tokens must lie"), ([-1], 0, jnp.float32, "tokens must lie"),
    ([], 0, jnp.float32, "B >= 1"), ([5], 0, jnp.int32, "floating point"), ([5], 1.0, jnp.float32, "position"),
], ids=["position-past-cache", "negative-position", "token-past-vocab", "negative-token", "no-sequence",
        "int-cache", "float-position"])
def test_an_eager_step_outside_the_vocabulary_or_the_cache_is_refused_by_name(model, tokens, position,
                                                                             cache_dtype, argument):
    cfg, params = model
    decoder = Qwen3MoeDecoder(params, cfg, SLOTS)
    batch = max(len(tokens), 1) if tokens != "vocab" else 1
    cache = tuple(part.astype(cache_dtype) for part in qwen3_moe.empty_cache(cfg, batch, 4))
    tokens = jnp.array([cfg.vocab_size] if tokens == "vocab" else tokens, jnp.int32)
    with pytest.raises(ValueError, match=argument):
        decoder(tokens, position, cache)
