"""The JAX MoE layer on an arena against the fully resident layer."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from conftest import assert_same_bits  # noqa: E402

from kq_core.contract import holds_every_expert  # noqa: E402
from kq_core.oracle import route_shed_oracle  # noqa: E402
from kq_jax.arena_moe import moe_ffn_arena  # noqa: E402
from kq_jax.moe import Experts, apply_gathered, combine, experts_apply, moe_ffn_resident, route  # noqa: E402

E, D, F, T, K = 16, 32, 24, 5, 4


@pytest.fixture
def layer():
    rng = np.random.default_rng(0)
    experts = Experts(*(jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.1)
                        for s in [(E, F, D), (E, F, D), (E, D, F)]))
    router = jnp.asarray(rng.normal(size=(D, E)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
    return rng, experts, router, x


def test_all_resident_arena_equals_the_resident_layer(layer):
    rng, experts, router, x = layer
    order = rng.permutation(E)  # slot s holds expert order[s]
    table = np.empty(E, np.int32)
    table[order] = np.arange(E)
    arena = Experts(*(w[order] for w in experts))
    want = jax.jit(lambda x: moe_ffn_resident(x, router, experts, top_k=K))(x)
    got, _ = jax.jit(lambda x, t: moe_ffn_arena(x, router, arena, t, top_k=K))(x, jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_experts_bits_do_not_depend_on_the_program_around_them(dtype, tokens):
    """The same routed experts through a fused gather, through a conditional (as the exact rule's
    filled misses come) and inside other work give the same bits: on a GPU the fusion XLA picks for
    the layer's reductions otherwise follows what surrounds them."""
    rng = np.random.default_rng(tokens)
    experts = Experts(*(jnp.asarray((rng.standard_normal(s) * 0.1 + 0.01).astype(dtype))
                        for s in [(E, F, D), (E, F, D), (E, D, F)]))
    x = jnp.asarray(rng.standard_normal((tokens, D)).astype(np.float32))
    rows = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    mix = jnp.asarray(rng.dirichlet(np.ones(K), size=tokens).astype(np.float32))

    def alone(x, rows, mix):
        return combine(experts_apply(x, experts, rows), mix)

    def through_a_conditional(x, rows, mix):
        gathered = Experts(*(w[rows] for w in experts))
        gathered = jax.lax.cond(jnp.all(rows >= 0), lambda g: g, lambda g: Experts(*(-w for w in g)), gathered)
        return combine(apply_gathered(x, gathered), mix)

    def inside_other_work(x, rows, mix):
        h = x * 1.5 + 0.25
        return combine(experts_apply(h, experts, rows), mix * jnp.exp(h[:, :1] * 0)) + h

    want = jax.jit(alone)(x, rows, mix)
    assert np.abs(np.asarray(want)).max() > 0
    assert_same_bits(want, jax.jit(through_a_conditional)(x, rows, mix))
    h = jax.jit(lambda x: x * 1.5 + 0.25)(x)
    assert_same_bits(jax.jit(alone)(h, rows, mix) + h, jax.jit(inside_other_work)(x, rows, mix))


def test_partial_arena_uses_only_resident_experts_renormalised(layer):
    rng, experts, router, x = layer
    resident = np.sort(rng.choice(E, 6, replace=False))
    table = np.full(E, -1, np.int32)
    table[resident] = np.arange(6)
    arena = Experts(*(w[resident] for w in experts))
    got, routing = jax.jit(lambda x, t: moe_ffn_arena(x, router, arena, t, top_k=K))(x, jnp.asarray(table))
    indices, scores = jax.jit(lambda x: route(x, router, top_k=K))(x)
    np.testing.assert_array_equal(np.asarray(routing.indices), np.asarray(indices))
    np.testing.assert_array_equal(np.asarray(routing.scores).view(np.uint32), np.asarray(scores).view(np.uint32))
    assert_same_bits(route_shed_oracle(np.asarray(indices), np.asarray(scores), table), routing.shed)
    mix = np.asarray(routing.shed.mix)
    assert (mix == 0).any() and (mix > 0).all(-1).sum() < T  # some experts were shed
    # The output mixes the full layer's experts by the renormalised weights, bit for bit: the experts'
    # computation is fenced, so gathering from arrays of different sizes compiles it alike.
    want = jax.jit(lambda x, mix: combine(experts_apply(x, experts, indices), mix))(x, mix)
    assert_same_bits(want, got)
    np.testing.assert_allclose(mix.sum(-1)[mix.any(-1)], 1.0, rtol=1e-5)


def test_packed_reports_are_the_layers_reports_bit_for_bit():
    """pack_reports (inside the jit) and LayerReport.from_packed (on the host): the layers' ids, scores
    and misses, one transfer, every bit kept (bf16 scores widened exactly)."""
    from kq_host.residency import LayerReport
    from kq_jax.arena import pack_reports

    rng = np.random.default_rng(7)
    T, D, F, E, S, K = 5, 16, 8, 12, 4, 3
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    routers = [jnp.asarray(rng.normal(size=(D, E)), jnp.bfloat16) for _ in range(2)]
    arena = Experts(*(jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for shape in ((S, F, D), (S, F, D), (S, D, F))))
    tables = [np.where(rng.random(E) < 0.4, rng.integers(0, S, E), -1).astype(np.int32) for _ in range(2)]
    routings = [moe_ffn_arena(x, w, arena, t, top_k=K)[1] for w, t in zip(routers, tables)]
    stacked = LayerReport.from_packed(np.asarray(jax.jit(pack_reports)(routings)))
    for layer, routing in enumerate(routings):
        for name, got in (("indices", stacked.indices), ("miss_ids", stacked.miss_ids)):
            want = np.asarray(routing.indices if name == "indices" else routing.shed.miss_ids)
            assert np.array_equal(got[layer], want.astype(np.int32)), name
        served = jnp.where(routing.shed.mix > 0, routing.scores, 0.0)
        for got, want in ((stacked.scores, routing.scores), (stacked.miss_scores, routing.shed.miss_scores),
                          (stacked.served, served)):
            assert np.array_equal(got[layer].view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("rule", ["route_shed", "shed", "tier"])
def test_a_table_holding_every_expert_runs_without_route_shed_in_the_rules_bits(dtype, tokens, rule):
    """full_table_moe (no route_shed, no tier) gives arena_moe's output and report, bit for bit, under the
    rules whose full-table layer weights each routed expert by its score, on a permuted table with two
    experts sharing a slot."""
    from kq_host.tier import quantize
    from kq_jax.arena_moe import arena_moe, full_table_moe
    from kq_jax.moe import tier_experts

    rng = np.random.default_rng(11)
    experts = Experts(*(jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.1, dtype)
                        for s in [(E, 32, 64), (E, 32, 64), (E, 64, 32)]))
    x = jnp.asarray(rng.normal(size=(tokens, 64)).astype(np.float32), dtype)
    router = jnp.asarray(rng.normal(size=(64, E)).astype(np.float32), dtype)
    table = rng.permutation(E).astype(np.int32)
    table[3] = table[5]  # still every expert resident
    assert holds_every_expert(table, E)
    experts = Experts(*(e.at[5].set(e[3]) for e in experts))  # the shared slot holds both
    arena = Experts(*(jnp.zeros_like(e).at[table].set(e) for e in experts))  # slot table[e] holds expert e
    layer = tier_experts({name: quantize(np.asarray(w, np.float32), bits=3, group_size=32)
                          for name, w in zip(("gate_proj", "up_proj", "down_proj"), experts)}, bits=3, group_size=32)
    indices, scores = route(x, router, top_k=K)
    want = jax.jit(lambda x, t: arena_moe(x, indices, scores, t, rule=rule, weights=arena, num_slots=E,
                                          tier=layer))(x, jnp.asarray(table))
    got = jax.jit(lambda x, t: full_table_moe(x, indices, scores, t, weights=arena))(x, jnp.asarray(table))
    assert np.asarray(got[0]).dtype == np.dtype(dtype)
    assert np.asarray(got[0]).tobytes() == np.asarray(want[0]).tobytes()
    for name, g, w in zip(("indices", "scores", "miss_ids", "miss_scores", "served"), got[1], want[1]):
        assert np.asarray(g).dtype == np.asarray(w).dtype and np.asarray(g).tobytes() == np.asarray(w).tobytes(), name
    resident = jax.jit(lambda x: combine(experts_apply(x, experts, indices), scores))(x)
    assert np.asarray(got[0]).tobytes() == np.asarray(resident).tobytes()


# ---- ids outside the router's experts, and arguments ------------------------------------------------------

def _layer(seed=1, experts=4, slots=2, hidden=8, ffn=8):
    rng = np.random.default_rng(seed)
    full = Experts(*(rng.normal(size=s).astype(np.float32)
                     for s in [(experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn)]))
    arena = Experts(*(jnp.asarray(w[:slots]) for w in full))
    x = rng.normal(size=(2, hidden)).astype(np.float32)
    return full, arena, x


@pytest.mark.parametrize("rule", ["route_shed", "shed", "renormalize", "stall", "exact"])
@pytest.mark.parametrize("bad", [7, -1])
def test_an_id_outside_the_experts_is_shed_under_every_rule(rule, bad):
    """An id outside [0, E) is no expert: route_shed sheds it (weight 0, not a miss), and so does every rule;
    JAX's indexing had clamped or wrapped it onto another expert, served at its score (exact: a negative id
    shifted every later miss's weights by one). Each row is the layer's output for its valid entries alone."""
    from kq_jax.arena_moe import arena_moe

    full, arena, x = _layer()
    table = np.array([0, 1, -1, -1], np.int32)
    scores = np.array([[0.5, 0.5], [0.25, 0.75]], np.float32)
    fetched = []

    def fetch(layer, ids):
        fetched.append(np.asarray(ids).tolist())
        return tuple(w[np.asarray(ids)] for w in full)

    indices = np.array([[bad, 2], [1, 3]], np.int32)
    arguments = dict(weights=full if rule == "stall" else arena, num_slots=2,
                     fetch=fetch if rule == "exact" else None)
    y, report = arena_moe(x, indices, scores, table, rule=rule, **arguments)
    kept = np.array([[0.0, 1.0], [1.0, 1.0]], np.float32)  # the valid entries
    same = np.where(kept > 0, indices, 0)
    want, want_report = arena_moe(x, same, scores * kept, table, rule=rule, **arguments)
    assert_same_bits(np.asarray(y), np.asarray(want))
    assert float(np.asarray(report[4])[0, 0]) == 0.0  # not served
    if rule == "exact":
        assert all(bad not in ids for ids in fetched) and fetched[0] == [2, 3]


def test_arena_moe_names_each_bad_argument():
    from kq_jax.arena_moe import arena_moe
    from kq_jax.moe import TierExperts, TierWeights

    full, arena, x = _layer()
    table = np.array([0, 1, -1, -1], np.int32)
    indices, scores = np.array([[0, 2], [1, 3]], np.int32), np.full((2, 2), 0.5, np.float32)
    full, arena, x = _layer(hidden=32, ffn=32)  # a tier's groups are 32 wide at least
    short = TierExperts(*(TierWeights(np.zeros((2, w.shape[1], w.shape[2] * 4 // 32), np.uint32),
                                      np.ones((2, w.shape[1], w.shape[2] // 32), np.float32),
                                      np.zeros((2, w.shape[1], w.shape[2] // 32), np.float32)) for w in full),
                        bits=4, group_size=32)
    cases = [
        (dict(num_slots=3), r"num_slots must be an int in \[1, 2\]"),
        (dict(num_slots=2, slot_rows=np.array([0], np.int32)), r"num_slots must be an int in \[1, 1\]"),
        (dict(x=x[:1]), r"x must be \[T, D\] = \[2, 32\]"),
        (dict(x=x[:, :4]), r"x must be \[T, D\]"),
        (dict(indices=indices[0]), r"indices and scores must be \[T, k\]"),
        (dict(rule="reroute"), r"rule 'reroute' routes with the router's probabilities"),
        (dict(rule="tier", tier=short), r"arena_moe: tier holds 2 experts, the router routes among 4"),
    ]
    for change, message in cases:
        arguments = dict(x=x, indices=indices, scores=scores, rule="shed", num_slots=2) | change
        with pytest.raises(ValueError, match=message):
            arena_moe(arguments.pop("x"), arguments.pop("indices"), arguments.pop("scores"), table, weights=arena,
                      **arguments)


def _same_bits(want, got):
    """``got`` has ``want``'s dtype, shape and every bit (an array compared whole, not row by row)."""
    want, got = np.asarray(want), np.asarray(got)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _on_the_cpu_only():
    """Skips a test comparing an eager layer with a jitted one off JAX's CPU backend: on a GPU two compiled
    programs need not agree to the bit (XLA fuses each its own way), so only the same program is compared there."""
    if jax.default_backend() != "cpu":
        pytest.skip(f"eager and jitted layers agree to the bit on JAX's CPU backend only (here: "
                    f"{jax.default_backend()})")


def _table_steps(table, weights, full):
    """The jitted steps that close over the manager's table and the arena's weights: full_table_moe, and
    arena_moe's exact rule fetching misses from ``full``; each ``(x, indices, scores) -> y``."""
    from kq_jax.arena_moe import arena_moe, full_table_moe

    full_table = jax.jit(lambda x, i, s: full_table_moe(x, i, s, table, weights=weights)[0])
    exact = jax.jit(lambda x, i, s: arena_moe(x, i, s, table, rule="exact", weights=weights, num_slots=4,
                                              fetch=lambda layer, ids: tuple(w[ids] for w in full))[0])
    return full_table, exact


def _table_inputs():
    full, arena, x = _layer(slots=4)
    table = np.array([0, 1, 2, 3], np.int32)
    indices, scores = np.array([[0, 2], [1, 3]], np.int32), np.full((2, 2), 0.5, np.float32)
    return full, Experts(*(np.asarray(w) for w in arena)), table, (x, indices, scores)


def test_numpy_tables_and_weights_are_taken_under_jit():
    """The manager's snapshot (a NumPy table) and NumPy weights, closed over in a jitted step, give the bits of
    the same step closed over JAX arrays of them (one program: it lowers alike, so it agrees on every backend)."""
    full, numpy_arena, table, inputs = _table_inputs()
    jax_steps = _table_steps(jnp.asarray(table), Experts(*map(jnp.asarray, numpy_arena)),
                             Experts(*map(jnp.asarray, full)))
    for numpy_step, jax_step in zip(_table_steps(table, numpy_arena, full), jax_steps):
        assert numpy_step.lower(*inputs).as_text() == jax_step.lower(*inputs).as_text()
        want = jax_step(*inputs)
        assert np.abs(np.asarray(want)).max() > 0
        _same_bits(want, numpy_step(*inputs))


def test_numpy_tables_and_weights_under_jit_give_the_eager_resident_layers_bits_on_the_cpu():
    """On the CPU the jitted steps closed over NumPy give the eager resident layer's bits."""
    _on_the_cpu_only()
    full, numpy_arena, table, (x, indices, scores) = _table_inputs()
    want = combine(experts_apply(x, full, indices), scores)
    for step in _table_steps(table, numpy_arena, full):
        _same_bits(want, step(x, indices, scores))


def _routing_layers():
    """Every layer that routes with kq_jax.moe.router_probs, as ``f(x, router_w) -> y``, on E experts of D = F
    = 32 (a tier's groups are 32 wide), half of them in the arena."""
    from kq_host.tier import quantize
    from kq_jax.arena_moe import moe_layer
    from kq_jax.arena_moe import moe_ffn_tiered
    from kq_jax.moe import TierExperts, TierWeights

    rng = np.random.default_rng(2)
    full = Experts(*(jnp.asarray(rng.normal(size=(E, 32, 32)).astype(np.float32) * 0.1) for _ in range(3)))
    tier = TierExperts(*(TierWeights(*map(jnp.asarray, quantize(np.asarray(w), bits=4, group_size=32)))
                         for w in full), bits=4, group_size=32)
    slots = E // 2
    arena = Experts(*(w[:slots] for w in full))
    table = jnp.where(jnp.arange(E) < slots, jnp.arange(E), -1).astype(jnp.int32)
    return {
        "resident": lambda x, r: moe_ffn_resident(x, r, full, top_k=K),
        "arena": lambda x, r: moe_ffn_arena(x, r, arena, table, top_k=K)[0],
        "tiered": lambda x, r: moe_ffn_tiered(x, r, arena, tier, table, top_k=K)[0],
        "moe_layer": lambda x, r: moe_layer(x, r, table, rule="shed", top_k=K, normalize=True, weights=arena,
                                            num_slots=slots)[0],
    }


@pytest.mark.parametrize("name", ["resident", "arena", "tiered", "moe_layer"])
def test_numpy_inputs_give_the_bits_of_jax_arrays(name):
    """NumPy x and router_w route through XLA's product, not NumPy's: the bits of the same JAX arrays."""
    layer = _routing_layers()[name]
    rng = np.random.default_rng(3)
    x, router = rng.normal(size=(8, 32)).astype(np.float32), rng.normal(size=(32, E)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(layer(x, router)).view(np.uint32),
                                  np.asarray(layer(jnp.asarray(x), jnp.asarray(router))).view(np.uint32))


@pytest.mark.parametrize("name", ["resident", "arena", "tiered", "moe_layer"])
def test_numpy_float64_inputs_are_taken_as_jit_takes_them(name):
    """Without x64, JAX takes NumPy float64 as float32, rounded to nearest: eagerly and jitted, each layer gives
    the bits of those float32 inputs through the same program (eagerly they had multiplied in NumPy's float64)."""
    layer = _routing_layers()[name]
    rng = np.random.default_rng(3)
    x, router = rng.normal(size=(8, 32)), rng.normal(size=(32, E))
    as_jit_takes = x.astype(np.float32), router.astype(np.float32)
    _same_bits(layer(*as_jit_takes), layer(x, router))
    jitted = jax.jit(layer)
    _same_bits(jitted(*as_jit_takes), jitted(x, router))


@pytest.mark.parametrize("name", ["resident", "arena", "tiered", "moe_layer"])
def test_eagerly_the_layers_give_jits_bits_on_the_cpu(name):
    """On the CPU an eager layer of NumPy float64 inputs gives the jitted layer's bits."""
    _on_the_cpu_only()
    layer = _routing_layers()[name]
    rng = np.random.default_rng(3)
    x, router = rng.normal(size=(8, 32)), rng.normal(size=(32, E))
    _same_bits(jax.jit(layer)(x, router), layer(x, router))


@pytest.mark.parametrize("argument", ["x", "router_w"])
@pytest.mark.parametrize("name", ["resident", "arena", "tiered", "moe_layer"])
def test_an_integer_input_is_refused_by_name(name, argument):
    layer = _routing_layers()[name]
    rng = np.random.default_rng(3)
    inputs = {"x": rng.normal(size=(8, 32)).astype(np.float32), "router_w": rng.normal(size=(32, E)).astype(np.float32)}
    inputs[argument] = inputs[argument].astype(np.int32)
    with pytest.raises(TypeError, match=f"{argument} must be an array of dtype float32 or bfloat16 or float16, got int32"):
        layer(inputs["x"], inputs["router_w"])
