"""kq_core.rules: one vocabulary for what a layer does with a routed expert that is not resident, run through
the JAX functional layer (kq_jax.arena_moe.moe_layer) and the NNX module (kq_jax.nnx.ArenaMoE) on the same
inputs, and the names the MLX adapter takes.

The layer is built so that each expert's output lies on one coordinate of its own (expert e's down
projection is zero but for row e): the layer's output at coordinate e is then exactly the product of
expert e's output and the weight the rule gave it, rounded once, and what a rule did to each routed entry
can be read off the output to the bit.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

from kq_core import rules
from kq_core.oracle import route_shed_oracle
from kq_core.rules import DEFAULT_RULE, RULE, RULES, check_rule

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp

from kq_jax import arena_moe as arena_moe_module
from kq_jax.arena import pack_reports
from kq_jax.arena_moe import arena_moe, moe_layer
from kq_jax.arena_moe import moe_ffn_arena, moe_ffn_tiered
from kq_jax.moe import experts_apply, router_probs, tiered_apply
from kq_jax.nnx import ArenaMoE, DenseMoE

D, F, E, K, T = 32, 32, 16, 4, 8
S = 8
RESIDENT = [0, 2, 5, 6, 9, 13]  # 6 of 16 experts, in slots 0..5 of an arena of 8
MODULE_RULES = tuple(rule for rule in RULES if rule != "stall")  # stall needs every expert, not an arena


def bits(array) -> np.ndarray:
    return np.asarray(array, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def dense():
    """A dense layer whose expert e writes coordinate e alone; top-k scores kept as the softmax's (a row's
    routed mass below 1, so carrying it and summing to 1 differ)."""
    layer = DenseMoE(D, F, E, K, normalize=False, rngs=nnx.Rngs(0))
    down = np.asarray(layer.kernel_down_proj_EDF[...])
    mask = np.zeros((E, D, 1), np.float32)
    mask[np.arange(E), np.arange(E)] = 1.0
    layer.kernel_down_proj_EDF.set_value(jnp.asarray(down * mask))
    return layer


@pytest.fixture(scope="module")
def rows():
    return jax.random.normal(jax.random.key(1), (T, D), jnp.float32) * 3.0


def _fetch(dense):
    experts = [np.asarray(w) for w in dense.experts()]
    return lambda layer, ids: tuple(w[np.asarray(ids)] for w in experts)


def _module(dense, rule, resident=RESIDENT):
    return ArenaMoE.from_dense(dense, resident=resident, num_slots=S, rule=rule,
                               fetch=_fetch(dense) if rule == "exact" else None)


def _table(resident=RESIDENT) -> np.ndarray:
    table = np.full(E, -1, np.int32)
    table[resident] = np.arange(len(resident), dtype=np.int32)
    return table


def _functional(dense, rows, rule, table, module):
    """moe_layer under ``rule`` on the module's arena and tier (for stall, every expert by id)."""
    kernel = dense.router.kernel_ED[...]
    weights, num_slots = (dense.experts(), E) if rule == "stall" else (module.arena(), S)
    tier = module.tier() if rule in rules.TIER_RULES else None
    return moe_layer(rows, kernel.T, jnp.asarray(table), rule=rule, top_k=K, normalize=False, weights=weights,
                     num_slots=num_slots, tier=tier, fetch=_fetch(dense) if rule == "exact" else None)


def _routing(dense, rows):
    probs = np.asarray(router_probs(rows, dense.router.kernel_ED[...].T))
    scores, indices = jax.lax.top_k(jnp.asarray(probs), K)
    return probs, np.asarray(indices), np.asarray(scores)


def _at(out, served) -> np.ndarray:
    """The output at each served expert's own coordinate: ``[T, k]``."""
    return np.take_along_axis(np.asarray(out), np.asarray(served), axis=-1)


def _products(y, served, weights) -> np.ndarray:
    """Each entry's output at its expert's coordinate times its weight, rounded once to float32."""
    own = np.take_along_axis(np.asarray(y), np.asarray(served)[..., None], axis=-1)[..., 0]
    return (own.astype(np.float32) * np.asarray(weights, np.float32)).astype(np.float32)


def _assert_only(out, served, weights, y):
    """The output is, at each served coordinate with a weight, the entry's product to the bit, and 0 at every
    other coordinate (a shed entry included)."""
    out = np.asarray(out)
    weights = np.asarray(weights, np.float32)
    want = _products(y, served, weights)
    kept = weights != 0
    assert kept.any() and (want[kept] != 0).all()
    np.testing.assert_array_equal(bits(_at(out, served)[kept]), bits(want[kept]))
    rest = np.ones(out.shape, bool)
    for t, k in zip(*np.nonzero(kept)):
        rest[t, served[t, k]] = False
    assert (out[rest] == 0).all()


def _recovered(out, y, served) -> np.ndarray:
    """The weights the layer gave each entry, read off the output: float64 ``[T, k]``."""
    own = np.take_along_axis(np.asarray(y), np.asarray(served)[..., None], axis=-1)[..., 0].astype(np.float64)
    return _at(out, served).astype(np.float64) / own


# ---- the vocabulary ----------------------------------------------------------------------------------


def test_every_rule_has_one_line_and_says_what_it_needs():
    assert set(RULES) >= {"exact", "tier", "shed", "route_shed", "renormalize", "substitute", "uniform", "stall",
                          "reroute", "prior"}
    for name in RULES:
        rule = RULE[name]
        assert rule.name == name and "\n" not in rule.meaning and rule.meaning.startswith(f"{name}: a miss ")
    assert rules.TIER_RULES == ("tier", "uniform") and rules.EXACT_RULES == ("exact", "stall")
    assert RULE["exact"].needs == ("reader",) and RULE["shed"].needs == () and RULE["stall"].needs == ("every expert",)
    assert set(rules.ROUTER_RULES) == {"route_shed", "renormalize", "substitute", "reroute", "prior"}
    assert DEFAULT_RULE == "shed" and not RULE[DEFAULT_RULE].needs


def test_jax_takes_the_names_of_kq_core():
    assert arena_moe_module.RULES == RULES
    assert arena_moe_module.TIER_RULES == rules.TIER_RULES
    assert arena_moe_module.RESIDENT_PRIOR == rules.RESIDENT_PRIOR


@pytest.mark.parametrize("name", ["drop", "", None, ["shed"], "SHED"])
def test_check_rule_names_the_argument_and_lists_the_rules(name):
    with pytest.raises(ValueError, match=r"^arena_moe: rule must be one of exact, tier, shed, route_shed"):
        check_rule(name, "arena_moe")
    with pytest.raises(ValueError, match=r"^kq generate: --rule must be one of exact, tier, shed; got"):
        check_rule(name, "kq generate", argument="--rule", allowed=("exact", "tier", "shed"))
    assert check_rule("route_shed", "x") == "route_shed"


def test_check_rule_refuses_an_allowed_list_of_unknown_names():
    with pytest.raises(ValueError, match="allowed holds \\['drop'\\]"):
        check_rule("shed", "x", allowed=("shed", "drop"))


def test_the_mlx_adapters_rules_are_kq_cores():
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from kq_mlx.mlx_lm_adapter import MISS_RULES, SEAM_RULES

    assert set(MISS_RULES) <= set(RULES), sorted(set(MISS_RULES) - set(RULES))
    # the rules it runs at the seam every family shares: those that need no router
    assert set(SEAM_RULES) == {rule for rule in MISS_RULES if rule in rules.SEAM_RULES}


def test_the_commands_rules_are_kq_cores_and_one_tuple_for_the_loader():
    from kq import demo, generate, model_options, study

    assert generate.RULES is model_options.RULES == ("exact", "tier", "shed")
    for names in (model_options.RULES, demo.DEMO_RULES, study.RULES):
        assert set(names) <= set(RULES), sorted(set(names) - set(RULES))
    assert study.RESIDENT_PRIOR is rules.RESIDENT_PRIOR
    if importlib.util.find_spec("mlx") is not None:
        from kq_mlx import load

        assert load.RULES == model_options.RULES
    with pytest.raises(ValueError, match=r"^kq demo: --rule must be one of tier, route_shed, shed, exact; got 'stall'"):
        demo.ModelDemoConfig(rule="stall", frameworks=("jax",))


def test_the_mlx_layers_start_under_the_default_rule_and_refuse_a_rule_they_do_not_run_by_name():
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import qwen3_moe
    from mlx_lm.models.switch_layers import SwitchGLU

    from kq_mlx.mlx_lm_adapter import ArenaMoeBlock, ArenaSwitch

    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=16,
        rms_norm_eps=1e-6, vocab_size=32, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=False, max_position_embeddings=64, norm_topk_prob=True)
    block = ArenaMoeBlock(qwen3_moe.Qwen3MoeSparseMoeBlock(args), 4)
    switch = ArenaSwitch(SwitchGLU(32, 16, 8), 4)
    for layer in (block, switch):
        assert layer.rule == DEFAULT_RULE
        for rule in ("drop", 3, None, "reroute", "uniform"):
            with pytest.raises(ValueError, match=f"^{type(layer).__name__}: rule must be one of "
                                                 f"{', '.join(layer.RULES)}; got"):
                layer.rule = rule
        assert layer.rule == DEFAULT_RULE
    for rule in block.RULES:
        block.rule = rule
        assert block.rule == rule
    with pytest.raises(ValueError, match="^ArenaSwitch: rule 'route_shed' rescales the gate weights"):
        switch.rule = "route_shed"


def test_the_layers_tier_defaults_are_kq_hosts(dense):
    """A tier rule's module, the Qwen3-MoE decoder and its functional steps, and the MLX arena's tier take
    kq_host.tier's one default format unless told otherwise."""
    import inspect

    from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE
    from kq_jax.qwen3_moe_arena import make_step, make_streams_step
    from kq_jax.qwen3_moe_nnx import Qwen3MoeDecoder

    for rule in rules.TIER_RULES:
        module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S, rule=rule)
        assert (module.tier_bits, module.tier_group_size) == (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE)
        assert module.tier_gating_packed[...].shape[-1] == D * DEFAULT_TIER_BITS // 32  # the packed words of a row
    defaults = [ArenaMoE.__init__, ArenaMoE.from_dense, Qwen3MoeDecoder.__init__]
    if importlib.util.find_spec("mlx") is not None:
        from kq_mlx.tier import arena_tier

        defaults.append(arena_tier)
    for function in defaults:
        parameters = inspect.signature(function).parameters
        bits, group = (("tier_bits", "tier_group_size") if "tier_bits" in parameters else ("bits", "group_size"))
        assert (parameters[bits].default, parameters[group].default) == (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE), \
            function.__qualname__
    for function in (make_step, make_streams_step):
        assert inspect.signature(function).parameters["tier_options"].default == (DEFAULT_TIER_BITS,
                                                                                 DEFAULT_TIER_GROUP_SIZE)


def test_a_rule_the_layers_do_not_know_is_refused_listing_the_names(dense, rows):
    module = _module(dense, "shed")
    for call in (lambda: _functional(dense, rows, "drop", _table(), module),
                 lambda: arena_moe(rows, *_routing(dense, rows)[1:], jnp.asarray(_table()), rule="drop",
                                   weights=module.arena(), num_slots=S)):
        with pytest.raises(ValueError, match="rule must be one of exact, tier, shed, route_shed, renormalize"):
            call()


# ---- each rule, the functional layer and the module on the same inputs ------------------------------------


@pytest.mark.parametrize("rule", MODULE_RULES)
def test_the_module_runs_the_functional_layer_under_each_rule(dense, rows, rule):
    module = _module(dense, rule)
    assert module.rule == rule
    want, report = _functional(dense, rows, rule, _table(), module)
    got, reports = module(rows)
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(bits(want), bits(got))
    np.testing.assert_array_equal(np.asarray(reports), np.asarray(pack_reports([report]))[:, 0])


def test_the_case_has_misses_and_hits(dense, rows):
    _, indices, _ = _routing(dense, rows)
    resident = np.isin(indices, RESIDENT)
    assert (~resident).any(axis=-1).sum() >= T // 2 and T - 2 <= resident.any(axis=-1).sum() < T  # a row missing all


def test_shed_drops_the_miss_and_keeps_the_routers_weights(dense, rows):
    module = _module(dense, "shed")
    _, indices, scores = _routing(dense, rows)
    out, _ = _functional(dense, rows, "shed", _table(), module)
    weights = np.where(np.isin(indices, RESIDENT), scores, 0.0)
    _assert_only(out, indices, weights, experts_apply(rows, dense.experts(), indices))
    missed = ~np.isin(indices, RESIDENT)
    assert (_at(out, indices)[missed] == 0).all()


def test_route_shed_rescales_the_kept_weights_to_the_routed_mass(dense, rows):
    module = _module(dense, "route_shed")
    _, indices, scores = _routing(dense, rows)
    out, _ = _functional(dense, rows, "route_shed", _table(), module)
    y = experts_apply(rows, dense.experts(), indices)
    mix = route_shed_oracle(indices, scores, _table(), num_slots=S).mix  # the contract's weights
    _assert_only(out, indices, mix, y)
    kept = np.isin(indices, RESIDENT)
    recovered = np.where(kept, _recovered(out, y, indices), 0.0)
    routed, hit = scores.astype(np.float64).sum(-1), kept.any(-1)  # a row that kept nothing carries nothing
    np.testing.assert_allclose(recovered.sum(-1)[hit], routed[hit], rtol=1e-6)
    assert (routed[hit & ~kept.all(-1)] < 0.99).sum() >= 2  # not 1: rescaling to it is not renormalizing
    shed_out, _ = _functional(dense, rows, "shed", _table(), module)
    assert not np.array_equal(bits(shed_out), bits(out))


def test_renormalize_scales_the_kept_weights_to_sum_to_one(dense, rows):
    module = _module(dense, "renormalize")
    _, indices, scores = _routing(dense, rows)
    out, _ = _functional(dense, rows, "renormalize", _table(), module)
    y = experts_apply(rows, dense.experts(), indices)
    kept = np.isin(indices, RESIDENT)
    recovered, hit = np.where(kept, _recovered(out, y, indices), 0.0), kept.any(-1)
    np.testing.assert_allclose(recovered.sum(-1)[hit], 1.0, rtol=1e-6)
    ratio = recovered / scores  # one factor a row
    for t in np.nonzero(hit)[0]:
        np.testing.assert_allclose(ratio[t][kept[t]], ratio[t][kept[t]][0], rtol=1e-6)
    assert (_at(out, indices)[~kept] == 0).all()


def test_tier_keeps_every_weight_a_miss_from_its_copy(dense, rows):
    module = _module(dense, "tier")
    _, indices, scores = _routing(dense, rows)
    out, _ = _functional(dense, rows, "tier", _table(), module)
    slots = route_shed_oracle(indices, scores, _table(), num_slots=S, on_miss="tier").slots
    y = tiered_apply(rows, module.arena(), module.tier(), jnp.asarray(slots))
    _assert_only(out, indices, scores, y)  # every weight the router's, none shed
    missed = ~np.isin(indices, RESIDENT)
    assert (_at(out, indices)[missed] != 0).all()
    full = experts_apply(rows, dense.experts(), indices)
    assert not np.array_equal(bits(_products(full, indices, scores)[missed]), bits(_at(out, indices)[missed]))


def test_uniform_runs_every_routed_expert_from_its_copy_whatever_the_table(dense, rows):
    module = _module(dense, "uniform")
    _, indices, scores = _routing(dense, rows)
    out, report = _functional(dense, rows, "uniform", _table(), module)
    y = tiered_apply(rows, module.arena(), module.tier(), jnp.asarray(S + indices))
    _assert_only(out, indices, scores, y)
    empty, _ = _functional(dense, rows, "uniform", np.full(E, -1, np.int32), module)
    np.testing.assert_array_equal(bits(empty), bits(out))
    np.testing.assert_array_equal(np.asarray(report[2]), indices)  # every routed expert reported missed


def test_substitute_serves_a_miss_with_the_best_resident_expert_the_row_did_not_choose(dense, rows):
    module = _module(dense, "substitute")
    probs, indices, scores = _routing(dense, rows)
    out, _ = _functional(dense, rows, "substitute", _table(), module)
    served, weights = indices.copy(), scores.copy()
    for t in range(T):
        spare = [e for e in np.argsort(-probs[t], kind="stable") if e in RESIDENT and e not in indices[t]]
        for k in range(K):
            if indices[t, k] not in RESIDENT:
                if spare:
                    served[t, k] = spare.pop(0)
                else:
                    weights[t, k] = 0.0
    assert (served != indices).any()
    _assert_only(out, served, weights, experts_apply(rows, dense.experts(), served))


@pytest.mark.parametrize("rule", ["reroute", "prior"])
def test_the_cache_aware_rules_choose_among_the_resident_experts(dense, rows, rule):
    module = _module(dense, rule)
    probs, indices, _ = _routing(dense, rows)
    out, _ = _functional(dense, rows, rule, _table(), module)
    resident = np.isin(np.arange(E), RESIDENT)
    if rule == "prior":
        chosen = np.asarray(jax.lax.top_k(jnp.log(jnp.asarray(probs)) + jnp.where(resident, 1.0, 0.0), K)[1])
    else:
        window = np.asarray(jax.lax.top_k(jnp.asarray(probs), 2 * K)[1])
        rest = window[:, K // 2:]
        fill = np.take_along_axis(rest, np.argsort(~resident[rest], axis=-1, kind="stable"), axis=-1)
        chosen = np.concatenate([window[:, :K // 2], fill[:, :K - K // 2]], axis=-1)
    weights = np.where(resident[chosen], np.take_along_axis(probs, chosen, axis=-1), 0.0)
    assert not np.array_equal(chosen, indices)
    _assert_only(out, chosen, weights, experts_apply(rows, dense.experts(), chosen))


@pytest.mark.parametrize("rule", ["exact", "stall"])
def test_the_exact_rules_give_the_full_residency_output_bit_for_bit(dense, rows, rule):
    module = _module(dense, "exact")
    full = ArenaMoE.from_dense(dense, rule="shed")  # every expert resident: nothing to shed
    want = full(rows)[0]
    np.testing.assert_array_equal(bits(dense(rows)), bits(want))
    got, report = _functional(dense, rows, rule, _table(), module)
    assert (np.asarray(report[2]) >= 0).any()  # there were misses
    np.testing.assert_array_equal(bits(want), bits(got))
    if rule == "exact":
        np.testing.assert_array_equal(bits(want), bits(module(rows)[0]))


def test_the_module_refuses_stall_naming_the_rule(dense):
    with pytest.raises(ValueError, match="rule 'stall'.*DenseMoE"):
        ArenaMoE(D, F, E, S, K, rule="stall", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rule must be one of exact, tier, shed, route_shed, renormalize, "
                                         "substitute, reroute, prior, uniform; got 'drop'"):
        ArenaMoE(D, F, E, S, K, rule="drop", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rule", ["shed", "route_shed", "renormalize", "substitute", "tier", "uniform"])
def test_sharded_rows_stay_on_their_devices_under_the_row_wise_rules(dense, rule):
    """Every rule but the cache-aware ones and exact routes through the one row-partitioned topk_route_shed
    launch: rows sharded over devices compile to no collective, with the single device's reports and (but
    for the tier's entries, whose bits depend on how many rows run together) its bits."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets XLA_FLAGS before JAX starts)")
    mesh = Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))
    module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S, rule=rule, impl="reference")
    graphdef, state = nnx.split(module)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    x = jax.random.normal(jax.random.key(6), (16, 2, D), jnp.float32)
    rows, replicated = NamedSharding(mesh, P("data", None, None)), NamedSharding(mesh, P())
    hlo = step.lower(jax.device_put(state, replicated), jax.device_put(x, rows)).compile().as_text()
    found = [name for name in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
             if name in hlo]
    assert not found, f"collectives in the compiled module: {found}"
    out, reports = step(jax.device_put(state, replicated), jax.device_put(x, rows))
    want, want_reports = step(jax.device_put(state, devices[0]), jax.device_put(x, devices[0]))
    np.testing.assert_array_equal(np.asarray(want_reports), np.asarray(reports))
    if rule in rules.TIER_RULES:  # a tier entry's bits depend on the rows computed together (docs/api.md)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(bits(want), bits(out))


# ---- the module's default and its old argument ---------------------------------------------------------


def test_the_modules_default_is_the_default_rule(dense, rows):
    module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S)
    assert module.rule == DEFAULT_RULE
    np.testing.assert_array_equal(bits(module(rows)[0]), bits(_module(dense, DEFAULT_RULE)(rows)[0]))
    plain = ArenaMoE(D, F, E, S, K, rngs=nnx.Rngs(0))
    assert plain.rule == DEFAULT_RULE


@pytest.mark.parametrize("on_miss, rule", [("shed", "route_shed"), ("tier", "tier"), ("fetch", "exact")])
def test_on_miss_is_taken_as_its_rule_with_a_deprecation_warning(dense, rows, on_miss, rule):
    fetch = _fetch(dense) if rule == "exact" else None
    with pytest.warns(DeprecationWarning, match=f"on_miss='{on_miss}' is rule='{rule}'"):
        module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S, on_miss=on_miss, fetch=fetch)
    assert module.rule == rule
    np.testing.assert_array_equal(bits(module(rows)[0]), bits(_module(dense, rule)(rows)[0]))
    with pytest.warns(DeprecationWarning):
        direct = ArenaMoE(D, F, E, S, K, on_miss=on_miss, fetch=fetch, rngs=nnx.Rngs(0))
    assert direct.rule == rule


def test_on_miss_shed_warns_that_shed_now_keeps_the_weights(dense):
    with pytest.warns(DeprecationWarning, match="rule='shed' keeps the kept weights as they are"):
        ArenaMoE(D, F, E, S, K, on_miss="shed", rngs=nnx.Rngs(0))


def test_rule_without_on_miss_warns_nothing(dense):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rule in ("shed", "route_shed", "tier"):
            ArenaMoE(D, F, E, S, K, rule=rule, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("options, argument", [
    ({"on_miss": "drop"}, "on_miss must be one of shed, tier, fetch"),
    ({"on_miss": "shed", "rule": "shed"}, "give rule or on_miss"),
    ({"rule": "exact"}, "fetch"), ({"rule": "shed", "fetch": lambda layer, ids: ()}, "fetch"),
    ({"rule": "uniform", "tier_bits": 5}, "tier_bits"),
])
def test_rule_arguments_it_cannot_take_are_refused_by_name(options, argument):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=argument):
            ArenaMoE(D, F, E, S, K, **options, rngs=nnx.Rngs(0))


# ---- the old functional layers are the one layer ---------------------------------------------------------


def test_moe_ffn_arena_and_moe_ffn_tiered_are_moe_layer_bit_for_bit():
    dense = DenseMoE(D, F, E, K, rngs=nnx.Rngs(2))  # normalize=True: the old layers' routing
    x = jax.random.normal(jax.random.key(3), (T, D), jnp.float32)
    table = jnp.asarray(_table())
    kernel = dense.router.kernel_ED[...]
    for rule, old in (("route_shed", lambda x, w, m: moe_ffn_arena(x, w, m.arena(), table, top_k=K)),
                      ("tier", lambda x, w, m: moe_ffn_tiered(x, w, m.arena(), m.tier(), table, top_k=K))):
        module = _module(dense, rule)
        tier = module.tier() if rule == "tier" else None
        want, report = moe_layer(x, kernel.T, table, rule=rule, top_k=K, normalize=True, weights=module.arena(),
                                 num_slots=S, tier=tier)
        jitted = jax.jit(lambda x, w, arena, tier, rule=rule: moe_layer(
            x, w, table, rule=rule, top_k=K, normalize=True, weights=arena, num_slots=S, tier=tier))
        want_jit, _ = jitted(x, kernel.T, module.arena(), tier)
        got, routing = old(x, kernel.T, module)
        np.testing.assert_array_equal(bits(want), bits(got))
        np.testing.assert_array_equal(np.asarray(pack_reports([routing])), np.asarray(pack_reports([report])))
        got_jit, routing = jax.jit(lambda x, w, old=old, module=module: old(x, w, module))(x, kernel.T)
        np.testing.assert_array_equal(bits(want_jit), bits(got_jit))
        np.testing.assert_array_equal(np.asarray(pack_reports([routing])), np.asarray(pack_reports([report])))
