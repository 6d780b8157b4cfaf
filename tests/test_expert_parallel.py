"""The expert-parallel arena layer on eight host devices against the single-device layers, bit for bit."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kq_jax.expert_parallel import arena_sharding, moe_ffn_arena_sharded  # noqa: E402
from kq_jax.arena_moe import moe_ffn_arena  # noqa: E402
from kq_jax.moe import Experts, moe_ffn_resident  # noqa: E402

E, D, F, T, K = 16, 32, 24, 8, 4
MESH_SHAPES = [(4, 2), (2, 4), (1, 8)]


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(7)
    experts = Experts(*(rng.normal(size=s).astype(np.float32) * 0.1 for s in [(E, F, D), (E, F, D), (E, D, F)]))
    router = rng.normal(size=(D, E)).astype(np.float32)
    x = rng.normal(size=(T, D)).astype(np.float32)
    return rng, experts, router, x


def _mesh(shape):
    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs eight host devices (tests/conftest.py sets XLA_FLAGS before JAX starts)")
    return Mesh(np.array(cpus[:8]).reshape(shape), ("data", "expert"))


def _run_sharded(mesh, x, router, arena, table, impl="auto"):
    args = (jax.device_put(x, NamedSharding(mesh, P("data", None))), jax.device_put(router, NamedSharding(mesh, P())),
            jax.device_put(arena, arena_sharding(mesh)), jax.device_put(table, NamedSharding(mesh, P())))
    return jax.jit(lambda x, r, a, t: moe_ffn_arena_sharded(x, r, a, t, top_k=K, mesh=mesh, impl=impl))(*args)


def _on_cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*jax.device_put(args, cpu))


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=[f"data{d}-expert{e}" for d, e in MESH_SHAPES])
def test_every_expert_resident_equals_the_resident_layer(layer, shape):
    rng, experts, router, x = layer
    order = rng.permutation(E)  # global slot s holds expert order[s]
    table = np.empty(E, np.int32)
    table[order] = np.arange(E, dtype=np.int32)
    arena = Experts(*(w[order] for w in experts))
    mesh = _mesh(shape)
    y, routing = _run_sharded(mesh, x, router, arena, table)
    want = _on_cpu(lambda x, r, e: moe_ffn_resident(x, r, e, top_k=K), x, router, experts)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    assert not np.asarray(routing.shed.miss_ids >= 0).any()
    np.testing.assert_array_equal(np.asarray(want).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_partial_arena_equals_the_single_device_arena_layer(layer, impl):
    rng, experts, router, x = layer
    resident = rng.choice(E, 8, replace=False)
    table = np.full(E, -1, np.int32)
    table[resident] = np.arange(8, dtype=np.int32)
    arena = Experts(*(w[resident] for w in experts))
    y, routing = _run_sharded(_mesh((2, 4)), x, router, arena, table, impl=impl)
    want_y, want_routing = _on_cpu(lambda x, r, a, t: moe_ffn_arena(x, r, a, t, top_k=K, impl="reference"),
                                   x, router, arena, table)
    assert np.asarray(routing.shed.miss_ids >= 0).any()  # some experts were shed
    for got, want in zip(jax.tree.leaves((y, routing)), jax.tree.leaves((want_y, want_routing))):
        np.testing.assert_array_equal(np.asarray(want).view(np.uint32), np.asarray(got).view(np.uint32))


def test_slots_must_split_over_the_expert_axis(layer):
    _, experts, router, x = layer
    arena = Experts(*(w[:6] for w in experts))
    with pytest.raises(ValueError, match="6 slots do not split over the 4 devices of mesh axis 'expert'"):
        moe_ffn_arena_sharded(x, router, arena, np.zeros(E, np.int32), top_k=K, mesh=_mesh((2, 4)))


@pytest.mark.parametrize("axes, argument", [(dict(expert_axis="bogus"), "expert_axis 'bogus'"),
                                            (dict(data_axis="rows"), "data_axis 'rows'")])
def test_an_axis_the_mesh_lacks_is_refused_by_name(layer, axes, argument):
    _, experts, router, x = layer
    with pytest.raises(ValueError, match=argument):
        moe_ffn_arena_sharded(x, router, experts, np.zeros(E, np.int32), top_k=K, mesh=_mesh((2, 4)), **axes)


def test_a_tuple_of_mesh_axes_holds_the_rows(layer):
    _, experts, router, x = layer
    mesh = _mesh((2, 4))
    rows_axes = tuple(name for name in mesh.axis_names if name != "expert")
    y, _ = moe_ffn_arena_sharded(x, router, experts, np.arange(E, dtype=np.int32), top_k=K, mesh=mesh,
                                 data_axis=rows_axes)
    assert y.shape == x.shape


@pytest.mark.parametrize("data_axis", ["expert", ("data", "expert")], ids=["the-expert-axis", "a-tuple-holding-it"])
def test_rows_over_the_expert_axis_are_refused_by_name(layer, data_axis):
    # the slots' sum over expert_axis would add outputs of different tokens: wrong results, no error
    _, experts, router, x = layer
    with pytest.raises(ValueError, match="data_axis .* must not hold expert_axis 'expert'"):
        moe_ffn_arena_sharded(x, router, experts, np.arange(E, dtype=np.int32), top_k=K, mesh=_mesh((2, 4)),
                              data_axis=data_axis)
