"""The ops on sharded rows: each device runs its own rows, no collective, the single-device bits.

Eight host devices (``tests/conftest.py`` asks XLA for them); with two or more
GPUs the compiled kernel runs on a GPU mesh as well.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kq_jax  # noqa: E402
from kq_core.inputs import slot_table  # noqa: E402
from kq_core.oracle import route_shed_oracle, topk_route_shed_oracle  # noqa: E402
from conftest import assert_same_bits  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
TOP_K, NUM_EXPERTS = 4, 24


def _meshes():
    meshes = []
    cpus = jax.devices("cpu")
    if len(cpus) >= 8:
        grid = np.array(cpus[:8]).reshape(4, 2)
        meshes += [("cpu", impl, grid) for impl in ("reference", "pallas_interpret")]
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) >= 2:
        grid = np.array(gpus[:2]).reshape(2, 1)
        meshes += [("gpu", impl, grid) for impl in ("reference", "pallas")]
    return meshes


MESHES = _meshes()
# Row layouts: (leading shape, partition spec of the leading dimensions).
LAYOUTS = {
    "rows-over-data": ((32,), P("data")),
    "rows-over-both-axes": ((32,), P(("data", "model"))),
    "batch-and-rows": ((4, 8), P("data", "model")),
    "batch-over-data": ((4, 8), P("data", None)),
}


@pytest.fixture(params=MESHES, ids=[f"{platform}-{impl}" for platform, impl, _ in MESHES])
def mesh_impl(request):
    _, impl, grid = request.param
    return Mesh(grid, ("data", "model")), impl


def _inputs(rng, leading):
    indices = rng.integers(-2, NUM_EXPERTS + 2, leading + (TOP_K,)).astype(np.int32)
    scores = rng.standard_normal(leading + (TOP_K,)).astype(np.float32) * 10 ** rng.uniform(-3, 3, leading + (TOP_K,))
    logits = rng.standard_normal(leading + (NUM_EXPERTS,)).astype(np.float32)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    table = slot_table(rng, NUM_EXPERTS, 0.5)
    return indices, scores.astype(np.float32), probs, table


def _rows(out):
    """Every output as NumPy ``[rows, K]``, the result's structure kept."""
    return jax.tree.map(lambda a: np.asarray(a).reshape(-1, TOP_K), out)


def _row_sharding(mesh, spec):
    return NamedSharding(mesh, P(*spec, None))


def _assert_partitioned(fn, args, mesh, spec):
    """Compiles ``fn``: no collective in its HLO; runs it: every output keeps the rows' sharding."""
    jitted = jax.jit(fn)
    hlo = jitted.lower(*args).compile().as_text()
    found = [c for c in COLLECTIVES if c in hlo]
    assert not found, f"collectives in the compiled op: {found}"
    out = jitted(*args)
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_equivalent_to(_row_sharding(mesh, spec), leaf.ndim), (leaf.sharding, spec)
    return out


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_route_shed_rows_stay_sharded(mesh_impl, layout, rng):
    mesh, impl = mesh_impl
    leading, spec = layout
    indices, scores, _, table = _inputs(rng, leading)
    args = (jax.device_put(indices, _row_sharding(mesh, spec)), jax.device_put(scores, _row_sharding(mesh, spec)),
            jax.device_put(table, NamedSharding(mesh, P())))
    out = _assert_partitioned(lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl), args, mesh, spec)
    expected = route_shed_oracle(indices.reshape(-1, TOP_K), scores.reshape(-1, TOP_K), table)
    assert_same_bits(expected, _rows(out))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_topk_route_shed_rows_stay_sharded(mesh_impl, layout, rng):
    mesh, impl = mesh_impl
    leading, spec = layout
    _, _, probs, table = _inputs(rng, leading)
    args = (jax.device_put(probs, _row_sharding(mesh, spec)), jax.device_put(table, NamedSharding(mesh, P())))
    out = _assert_partitioned(lambda p, t: kq_jax.topk_route_shed(p, t, top_k=TOP_K, impl=impl), args, mesh, spec)
    expected = topk_route_shed_oracle(probs.reshape(-1, NUM_EXPERTS), table, top_k=TOP_K)
    assert_same_bits(expected, _rows(out))


def test_substitute_rows_stay_sharded(mesh_impl, rng):
    mesh, impl = mesh_impl
    if impl != "reference":
        pytest.skip("on_miss='substitute' runs the reference")
    spec = P("data")
    _, _, probs, table = _inputs(rng, (32,))
    args = (jax.device_put(probs, _row_sharding(mesh, spec)), jax.device_put(table, NamedSharding(mesh, P())))
    out = _assert_partitioned(
        lambda p, t: kq_jax.topk_route_shed(p, t, top_k=TOP_K, on_miss="substitute", impl=impl), args, mesh, spec)
    expected = topk_route_shed_oracle(probs, table, top_k=TOP_K, on_miss="substitute")
    assert_same_bits(expected, _rows(out))


def test_vmap_and_scan_over_sharded_rows(mesh_impl, rng):
    """vmap over a batch axis and lax.scan over steps, the rows inside sharded: the single-device bits."""
    mesh, impl = mesh_impl
    indices, scores, probs, table = _inputs(rng, (4, 16))
    sharding = NamedSharding(mesh, P(None, "data", None))
    indices_s, scores_s, probs_s = (jax.device_put(a, sharding) for a in (indices, scores, probs))
    table_s = jax.device_put(table, NamedSharding(mesh, P()))

    def shed(i, s, t):
        return kq_jax.route_shed(i, s, t, impl=impl)

    def routed(p, t):
        return kq_jax.topk_route_shed(p, t, top_k=TOP_K, impl=impl)

    expected = route_shed_oracle(indices.reshape(-1, TOP_K), scores.reshape(-1, TOP_K), table)
    expected_topk = topk_route_shed_oracle(probs.reshape(-1, NUM_EXPERTS), table, top_k=TOP_K)
    vmapped = jax.jit(jax.vmap(shed, in_axes=(0, 0, None)))(indices_s, scores_s, table_s)
    _, scanned = jax.jit(lambda i, s, t: jax.lax.scan(lambda c, x: (c, shed(*x, t)), 0, (i, s)))(
        indices_s, scores_s, table_s)
    vmapped_topk = jax.jit(jax.vmap(routed, in_axes=(0, None)))(probs_s, table_s)
    for out, want in ((vmapped, expected), (scanned, expected), (vmapped_topk, expected_topk)):
        assert_same_bits(want, _rows(out))


def test_vmap_over_slot_tables(rng):
    """A batched slot table (one per batch element): one launch per table, each row against its own table."""
    impl = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
    indices, scores, _, _ = _inputs(rng, (3, 8))
    tables = np.stack([slot_table(rng, NUM_EXPERTS, f) for f in (0.0, 0.3, 1.0)])
    out = jax.jit(jax.vmap(lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl)))(indices, scores, tables)
    for b in range(3):
        expected = route_shed_oracle(indices[b], scores[b], tables[b])
        assert_same_bits(expected, jax.tree.map(lambda a, b=b: np.asarray(a)[b], out))


def test_gradient_keeps_rows_sharded(mesh_impl, rng):
    mesh, impl = mesh_impl
    indices, scores, _, table = _inputs(rng, (32,))
    sharding = _row_sharding(mesh, P("data"))
    args = (jax.device_put(indices, sharding), jax.device_put(scores, sharding),
            jax.device_put(table, NamedSharding(mesh, P())))
    grad = jax.jit(jax.grad(lambda s, i, t: kq_jax.route_shed(i, s, t, impl=impl).mix.sum()))
    got = grad(args[1], args[0], args[2])
    # The reference's gradient on one device of the mesh's platform (gradients are not held across backends).
    device = mesh.devices.flat[0]
    want = jax.jit(jax.grad(lambda s, i, t: kq_jax.route_shed_reference(i, s, t).mix.sum()))(
        *jax.device_put((scores, indices, table), device))
    assert got.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(np.asarray(want).view(np.uint32), np.asarray(got).view(np.uint32))
