"""kq_jax.nnx: the arena MoE as a Flax NNX module, against the dense module and kq_jax.moe's functional layers.

Eight host devices for the sharded case (``tests/conftest.py`` asks XLA for them).
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kq_core.reports import REPORT_FIELDS  # noqa: E402
from kq_host.residency import LayerReport, ResidencyManager  # noqa: E402
from kq_jax.arena import JaxArena, pack_reports  # noqa: E402
from kq_jax.arena_moe import moe_ffn_arena, moe_ffn_tiered  # noqa: E402
from kq_jax.moe import Experts, combine, experts_apply, route  # noqa: E402
from kq_jax.nnx import EXPERT_PROJECTIONS, ArenaMoE, ArenaSlots, DenseMoE, SlotTable  # noqa: E402
from test_optional_backends import BLOCK  # noqa: E402

D, F, E, K, T = 32, 32, 8, 2, 6
RESIDENT = [1, 3, 4, 6]  # of E experts, in slots 0..3 of an arena of S = 5
S = 5
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint32)


def assert_same_bits(want, got):
    np.testing.assert_array_equal(bits(want), bits(got))


@pytest.fixture(scope="module")
def dense():
    return DenseMoE(D, F, E, K, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def inputs():
    return jax.random.normal(jax.random.key(1), (2, T // 2, D), jnp.float32)  # [B, T, D]: T rows in all


def _call(module, x):
    return nnx.jit(lambda module, x: module(x))(module, x)


def _paths(state) -> list[tuple]:
    return [tuple(path) for path, _ in nnx.to_flat_state(state)]


def _field(reports, name: str) -> np.ndarray:
    return np.asarray(reports)[REPORT_FIELDS.index(name)]


def _misses(reports) -> np.ndarray:
    return _field(reports, "miss_ids")


# ---- every expert resident: the dense module's bits --------------------------------------------------


@pytest.mark.parametrize("rule", ["route_shed", "tier", "shed"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "nnx.jit"])
def test_every_expert_resident_is_the_dense_module_bit_for_bit(dense, inputs, rule, jitted):
    module = ArenaMoE.from_dense(dense, rule=rule)
    want = _call(dense, inputs) if jitted else dense(inputs)
    got, reports = _call(module, inputs) if jitted else module(inputs)
    assert got.shape == inputs.shape and reports.shape == (len(REPORT_FIELDS), T, K) and reports.dtype == jnp.int32
    assert np.abs(np.asarray(want)).max() > 0
    assert_same_bits(want, got)
    assert (_misses(reports) == -1).all()


def test_a_permuted_arena_set_by_the_host_keeps_the_dense_bits(dense, inputs):
    """The host hands the module another placement (slot s holds expert order[s]) between steps."""
    module = ArenaMoE.from_dense(dense, num_slots=E + 2)
    order = np.random.default_rng(2).permutation(E)
    table = np.empty(E, np.int32)
    table[order] = np.arange(E)
    arena = {name: jnp.zeros((E + 2, *w.shape[1:]), w.dtype).at[:E].set(w[order])
             for name, w in zip(EXPERT_PROJECTIONS, dense.experts())}
    module.set_residency(table, arena)
    got, reports = _call(module, inputs)
    assert_same_bits(_call(dense, inputs), got)
    ids, score_bits = _field(reports, "ids"), _field(reports, "scores")
    indices, scores = jax.jit(lambda x, w: route(x, w.T, top_k=K))(inputs.reshape(-1, D), dense.router.kernel_ED[...])
    np.testing.assert_array_equal(ids, np.asarray(indices))
    np.testing.assert_array_equal(score_bits.view(np.uint32), bits(scores))


def test_the_router_is_the_dense_routers_top_k(dense, inputs):
    weights_TX, experts_TX = dense.router(inputs)
    indices, scores = route(inputs.reshape(-1, D), dense.router.kernel_ED[...].T, top_k=K)
    assert experts_TX.dtype == jnp.int32 and weights_TX.shape == (T, K)
    np.testing.assert_array_equal(np.asarray(experts_TX), np.asarray(indices))
    assert_same_bits(scores, weights_TX)


# ---- a partial arena: the functional layers' bits ----------------------------------------------------


def _partial(dense, rule, impl="auto"):
    module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S, rule=rule, impl=impl)
    table = np.full(E, -1, np.int32)
    table[RESIDENT] = np.arange(len(RESIDENT))
    return module, jnp.asarray(table)


def test_route_shed_rule_is_the_functional_arena_layer(dense, inputs):
    module, table = _partial(dense, "route_shed")
    got, reports = _call(module, inputs)
    rows = inputs.reshape(-1, D)
    # Every array an argument, as the module's are under nnx.jit (a closed-over constant XLA may fold).
    want, routing = jax.jit(lambda x, w, arena, t: moe_ffn_arena(x, w.T, arena, t, top_k=K))(
        rows, dense.router.kernel_ED[...], module.arena(), table)
    assert (_misses(reports) >= 0).any() and (np.asarray(routing.shed.mix) > 0).all(-1).sum() < T
    assert_same_bits(want.reshape(inputs.shape), got)
    np.testing.assert_array_equal(np.asarray(reports), np.asarray(pack_reports([routing]))[:, 0])


def test_tier_rule_is_the_functional_tiered_layer(dense, inputs):
    module, table = _partial(dense, "tier")
    got, reports = _call(module, inputs)
    rows = inputs.reshape(-1, D)
    tier = module.tier()
    want, routing = jax.jit(lambda x, w, arena, tier, t: moe_ffn_tiered(x, w.T, arena, tier, t, top_k=K))(
        rows, dense.router.kernel_ED[...], module.arena(), tier, table)
    assert (_misses(reports) >= 0).any()
    assert_same_bits(want.reshape(inputs.shape), got)
    np.testing.assert_array_equal(np.asarray(reports), np.asarray(pack_reports([routing]))[:, 0])
    # The misses ran from the tier, not shed: the shed layer's output differs.
    shed, _ = _call(_partial(dense, "route_shed")[0], inputs)
    assert not np.array_equal(bits(shed), bits(got))


# ---- the host between steps: the residency manager and a JaxArena ------------------------------------


def _loader(weights: Experts):
    """A loader of ``{projection: [L, E, ...]}`` host weights: each read returns the expert's payload."""
    host = {name: np.asarray(w) for name, w in zip(EXPERT_PROJECTIONS, weights)}

    def load(layer, expert, slot):
        return {name: w[layer, expert] for name, w in host.items()}
    return load


def _arena_of(num_layers, weights: Experts, num_slots=S):
    return JaxArena(num_layers, num_slots, {name: (w.shape[-2:], w.dtype) for name, w in zip(EXPERT_PROJECTIONS,
                                                                                                weights)})


def test_exact_mode_acquires_the_misses_and_gives_the_dense_bits(dense, inputs):
    """The exact loop's step for one layer: the module reports its misses, the manager's ``acquire`` reads
    them into the arena, and the module called again on the new residency runs every routed expert at its
    own score: the dense module's bits and the functional exact layer's. Decode-sized: two sequences of one
    token, so the routed experts fit the slots."""
    inputs = inputs[:, :1]
    stacked = Experts(*(w[None] for w in dense.experts()))
    arena = _arena_of(1, stacked)
    manager = ResidencyManager(1, E, S, loader=_loader(stacked), arena=arena, queue_depth=0)
    manager.preload(0, RESIDENT[:2])
    module = ArenaMoE(D, F, E, S, K, rngs=nnx.Rngs(5))
    module.router.kernel_ED.set_value(dense.router.kernel_ED[...])
    module.set_residency(manager.snapshot()[0], {name: a[0] for name, a in arena.arrays.items()})
    _, reports = _call(module, inputs)
    assert (_misses(reports) >= 0).any()
    routed = LayerReport.from_packed(np.asarray(reports)[:, None])
    table = manager.acquire(0, routed.indices[0], routed.scores[0])
    module.set_residency(table, {name: a[0] for name, a in arena.arrays.items()})
    got, reports = _call(module, inputs)
    assert (_misses(reports) == -1).all()
    assert_same_bits(_call(dense, inputs), got)
    rows = inputs.reshape(-1, D)
    indices, scores = jax.jit(lambda x, w: route(x, w.T, top_k=K))(rows, dense.router.kernel_ED[...])
    exact = jax.jit(lambda rows, arena, table: combine(experts_apply(rows, arena, table[indices]), scores))(
        rows, module.arena(), jnp.asarray(table))
    assert_same_bits(exact.reshape(inputs.shape), got)
    manager.close()


L = 2


def _stack(rule="route_shed"):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return ArenaMoE(D, F, E, S, K, rule=rule, rngs=rngs)
    return create(nnx.Rngs(3))


@nnx.jit
def _scan(stack, h):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 1))
    def layer(h, moe):
        y, reports = moe(h)
        return h + y, reports
    return layer(h, stack)


def _loop(kernels, arrays, tables, h):
    """The functional layers one after the other: the scan's bits, layer by layer."""
    routings = []
    for layer in range(L):
        arena = Experts(*(arrays[name][layer] for name in EXPERT_PROJECTIONS))
        y, routing = jax.jit(lambda h, w, a, t: moe_ffn_arena(h, w.T, a, t, top_k=K))(h, kernels[layer], arena,
                                                                                    tables[layer])
        h, routings = h + y, routings + [routing]
    return h, pack_reports(routings)


def test_nnx_scan_over_layers_steps_with_the_manager(inputs):
    """A stack of layers under nnx.scan takes the manager's [L, E] tables and the JaxArena's [L, S, ...] arrays
    as they are; its reports, stacked on axis 1, are what the manager's step reads; each token's output is
    the functional layers' run one after the other, bit for bit."""
    stack = _stack()
    assert stack.slot_table_E[...].shape == (L, E) and stack.arena_gating_SFD[...].shape == (L, S, F, D)
    rng = np.random.default_rng(4)
    weights = Experts(*(jnp.asarray(rng.normal(size=(L, E, *shape)).astype(np.float32) / 6)
                        for shape in ((F, D), (F, D), (D, F))))
    arena = _arena_of(L, weights)
    manager = ResidencyManager(L, E, S, loader=_loader(weights), arena=arena, queue_depth=0)
    for layer in range(L):
        manager.preload(layer, RESIDENT[layer:layer + 3])
    tables = manager.snapshot()
    h = inputs.reshape(-1, D)
    kernels = stack.router.kernel_ED[...]
    missed = []
    for _ in range(3):
        stack.set_residency(tables, arena.arrays)
        out, reports = _scan(stack, h)
        assert reports.shape == (len(REPORT_FIELDS), L, T, K)
        want, want_reports = _loop(kernels, arena.arrays, tables, h)
        assert_same_bits(want, out)
        np.testing.assert_array_equal(np.asarray(reports), np.asarray(want_reports))
        missed.append(int((_misses(reports) >= 0).sum()))
        tables = manager.step(LayerReport.from_packed(np.asarray(reports)))
    assert missed[0] > missed[-1]  # the step read the misses into the arena
    manager.close()


# ---- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["route_shed", "tier"])
def test_gradients_through_the_mix_are_the_functional_layers(dense, inputs, rule):
    module, table = _partial(dense, rule)
    rows = inputs.reshape(-1, D)
    target = jnp.sin(rows)

    def loss(module):
        y, _ = module(inputs)
        return jnp.sum((y.reshape(-1, D) - target) ** 2)

    def functional(kernel, arena, tier, table):
        extra = (tier,) if rule == "tier" else ()
        y, _ = (moe_ffn_tiered if rule == "tier" else moe_ffn_arena)(rows, kernel.T, arena, *extra, table, top_k=K)
        return jnp.sum((y - target) ** 2)

    grads = nnx.jit(nnx.grad(loss))(module)
    assert _paths(grads) == [("router", "kernel_ED")]  # the arena, table and tier are no Params
    got = grads["router"]["kernel_ED"][...]
    tier = module.tier() if rule == "tier" else None
    want = jax.jit(jax.grad(functional))(dense.router.kernel_ED[...], module.arena(), tier, table)
    assert np.abs(np.asarray(want)).max() > 0
    assert_same_bits(want, got)


@pytest.mark.parametrize("rule", ["route_shed", "tier"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_every_expert_resident_gives_the_dense_modules_gradients_bit_for_bit(rule, jitted):
    """The shed rule's weights are the router's scores times total / kept mass, 1 when nothing is shed: its
    derivative is written so that it is exactly 0 then, and the gradients are the dense module's bits."""
    dense = DenseMoE(64, F, E, K, rngs=nnx.Rngs(0))
    inputs = jax.random.normal(jax.random.key(1), (6, 64), jnp.float32)
    module = ArenaMoE.from_dense(dense, rule=rule)

    def loss(module):
        y = module(inputs)
        return jnp.sum(y[0] if isinstance(y, tuple) else y)

    grad = nnx.jit(nnx.grad(loss)) if jitted else nnx.grad(loss)
    want = grad(dense)["router"]["kernel_ED"][...]
    got = grad(module)["router"]["kernel_ED"][...]
    assert np.abs(np.asarray(want)).max() > 0
    assert_same_bits(want, got)

    def input_grad(layer):  # the gradient a layer below receives
        step = jax.grad(lambda x: jnp.sum(jnp.asarray(layer(x)[0] if isinstance(layer, ArenaMoE) else layer(x))))
        return (jax.jit(step) if jitted else step)(inputs)
    assert_same_bits(input_grad(dense), input_grad(module))


# ---- sharded rows -------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["route_shed", "tier", "shed"])
def test_sharded_rows_stay_on_their_devices_with_the_single_device_bits(dense, rule):
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets XLA_FLAGS before JAX starts)")
    mesh = Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))
    module, _ = _partial(dense, rule, impl="reference")  # the host devices' impl, also beside a GPU
    x = jax.random.normal(jax.random.key(6), (16, 2, D), jnp.float32)  # [B, T, D], the batch over "data"
    graphdef, state = nnx.split(module)
    rows = NamedSharding(mesh, P("data", None, None))
    sharded_state = jax.device_put(state, NamedSharding(mesh, P()))
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    hlo = step.lower(sharded_state, jax.device_put(x, rows)).compile().as_text()
    found = [name for name in COLLECTIVES if name in hlo]
    assert not found, f"collectives in the compiled module: {found}"
    out, reports = step(sharded_state, jax.device_put(x, rows))
    assert out.sharding.is_equivalent_to(rows, 3)
    assert reports.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", None)), 3)
    want, want_reports = step(jax.device_put(state, devices[0]), jax.device_put(x, devices[0]))
    assert_same_bits(want, out)
    np.testing.assert_array_equal(np.asarray(want_reports), np.asarray(reports))


@pytest.mark.parametrize("rule", ["route_shed", "tier"])
def test_no_rows_give_empty_outputs_and_reports(dense, rule):
    module = ArenaMoE.from_dense(dense, resident=RESIDENT, num_slots=S, rule=rule)
    out, reports = _call(module, jnp.zeros((2, 0, D), jnp.float32))
    assert out.shape == (2, 0, D) and reports.shape == (len(REPORT_FIELDS), 0, K)


def test_no_rows_fetch_nothing(inputs):
    calls = []
    module = ArenaMoE(D, F, E, S, K, rule="exact", fetch=lambda layer, ids: calls.append(ids), rngs=nnx.Rngs(0))
    out, reports = _call(module, jnp.zeros((2, 0, D), jnp.float32))
    assert out.shape == (2, 0, D) and reports.shape == (len(REPORT_FIELDS), 0, K) and calls == []


@pytest.mark.parametrize("layer", [1.5, -1, "a", True], ids=["float", "negative", "str", "bool"])
def test_a_layer_fetch_cannot_be_told_is_refused_by_name(inputs, layer):
    module = ArenaMoE(D, F, E, S, K, rule="exact", fetch=lambda layer, ids: None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer"):
        module(inputs, layer=layer)


# ---- bad arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, argument", [
    (dict(hidden_size=0), "hidden_size"), (dict(intermediate_size=2.0), "intermediate_size"),
    (dict(num_slots=0), "num_slots"), (dict(top_k=E + 1), "top_k"), (dict(on_miss="drop"), "on_miss"),
    (dict(rule="drop"), "rule"), (dict(impl="cuda"), "impl"), (dict(rule="tier", tier_bits=5), "tier_bits"),
    (dict(rule="tier", tier_group_size=16), "tier_group_size"),
    (dict(rule="tier", hidden_size=48), "hidden_size"), (dict(normalize="yes"), "normalize"),
    (dict(dtype=jnp.int32), "dtype must be a floating-point dtype"),
])
def test_a_layer_it_cannot_build_is_refused_by_name(options, argument):
    sizes = dict(hidden_size=D, intermediate_size=F, num_experts=E, num_slots=S, top_k=K)
    with pytest.raises(ValueError, match=argument):
        ArenaMoE(**{**sizes, **options}, rngs=nnx.Rngs(0))


def test_integer_inputs_are_refused_by_name(dense):
    """Token ids handed where hidden states go: refused, not routed as numbers."""
    module, _ = _partial(dense, "route_shed")
    for layer in (module, dense):
        with pytest.raises(ValueError, match="inputs must be floating point"):
            layer(np.ones((2, D), np.int32))


def test_bad_residency_is_refused_by_name_and_changes_nothing(dense):
    module, table = _partial(dense, "route_shed")
    before = {name: bits(v[...]) for name, v in (("table", module.slot_table_E), ("gate", module.arena_gating_SFD))}
    good = {name: jnp.zeros(w.shape, w.dtype) for name, w in zip(EXPERT_PROJECTIONS, module.arena())}
    for call, argument in (
            (lambda: module.set_residency(np.zeros(E + 1, np.int32)), "slot_table"),
            (lambda: module.set_residency(np.zeros(E, np.float32)), "slot_table"),
            (lambda: module.set_residency(np.full(E, 2**40)), "int32"),
            # a JAX uint32 table's 2**31 + 1 wrapped to -2**31 + 1 (its values are not read back to check)
            (lambda: module.set_residency(jnp.full(E, 2**31 + 1, jnp.uint32)), "a JAX slot_table must be int32"),
            (lambda: module.set_residency(table, {**good, "gate_proj": good["gate_proj"].astype(jnp.bfloat16)}),
             "gate_proj"),
            (lambda: module.set_residency(table, {**good, "up_proj": np.zeros((S, F, D), np.float64)}), "up_proj"),
            (lambda: module.set_residency(table, {"gate": good["gate_proj"]}), "arena"),
            (lambda: module.set_tier(None), "set_tier"),
            (lambda: module.tier(), "tier"),
            (lambda: module(jnp.ones((3, D + 1))), "inputs"),
            (lambda: ArenaMoE.from_dense(dense, resident=[1, 1]), "resident"),
            (lambda: ArenaMoE.from_dense(dense, resident=[E]), "resident"),
            (lambda: ArenaMoE.from_dense(dense, resident=[0, 1], num_slots=1), "num_slots"),
            (lambda: ArenaMoE.from_dense(dense, resident=[1.7, 2.2]), "resident must be int"),
            (lambda: ArenaMoE.from_dense(dense, resident=[True, False]), "resident must be int"),
            (lambda: module.set_residency(np.array([0, 0, 1, 2, 3, -1, -1, -1], np.int32)), "two experts to slot 0"),
            (lambda: module.set_residency(np.array([4, -1, 1, 2, 3, -1, 4, 0], np.int32)), "two experts to slot 4")):
        with pytest.raises(ValueError, match=argument):
            call()
    after = {name: bits(v[...]) for name, v in (("table", module.slot_table_E), ("gate", module.arena_gating_SFD))}
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_a_tier_modules_state_restored_into_a_new_module_steps_with_the_same_bits(dense, inputs):
    """The tier is state like the arena: a fresh module updated with a saved module's state (as a checkpoint
    restore does) serves its misses from the restored tier."""
    module, _ = _partial(dense, "tier")
    want, _ = _call(module, inputs)
    fresh = ArenaMoE(D, F, E, S, K, rule="tier", rngs=nnx.Rngs(3))
    nnx.update(fresh, nnx.state(module))
    got, _ = _call(fresh, inputs)
    assert np.abs(np.asarray(want)).min() > 0
    assert_same_bits(want, got)


def test_a_tier_of_another_format_is_refused(dense):
    module = ArenaMoE.from_dense(dense, rule="tier", tier_bits=4)
    other = ArenaMoE.from_dense(dense, rule="tier", tier_bits=2)
    with pytest.raises(ValueError, match="tier_bits=4"):
        module.set_tier(other.tier())


def test_the_module_state_is_typed_for_filters(dense):
    module = ArenaMoE.from_dense(dense)
    assert sorted(_paths(nnx.state(module, ArenaSlots))) == [
        ("arena_down_proj_SDF",), ("arena_gating_SFD",), ("arena_up_proj_SFD",)]
    assert _paths(nnx.state(module, SlotTable)) == [("slot_table_E",)]
    assert _paths(nnx.state(module, nnx.Param)) == [("router", "kernel_ED")]


# ---- Flax is optional -----------------------------------------------------------------------------


WITHOUT_FLAX = BLOCK + textwrap.dedent("""
    import numpy as np
    import kq_jax, kq_jax.arena, kq_jax.arena_moe, kq_jax.exact_loop, kq_jax.moe, kq_jax.qwen3_moe
    import kq_jax.qwen3_moe_arena

    out = kq_jax.route_shed(np.array([[7, 5]], np.int32), np.array([[0.75, 0.25]], np.float32),
                            np.array([-1] * 7 + [1], np.int32))
    print(np.asarray(out.slots).tolist(), np.asarray(out.mix).tolist())
    assert "flax" not in {{m.split(".")[0] for m in sys.modules}}
    for name in ("kq_jax.nnx", "kq_jax.qwen3_moe_nnx"):
        try:
            __import__(name)
        except ImportError as error:
            print("refused:", error)
""")


def test_the_rest_of_kq_jax_works_without_flax():
    done = subprocess.run([sys.executable, "-c", WITHOUT_FLAX.format(blocked="flax")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, *refusals = done.stdout.splitlines()
    assert first == "[[1, 1]] [[1.0, 0.0]]"  # expert 5 shed, its weight on expert 7
    assert len(refusals) == 2 and all(line.startswith("refused:") and "kq[nnx]" in line for line in refusals)
