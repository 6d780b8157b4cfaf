"""kq_jax under jit, vmap, scan and grad, for every implementation that runs here."""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
chex = pytest.importorskip("chex")
import jax.numpy as jnp  # noqa: E402
from conftest import assert_same_bits  # noqa: E402
from jax_impls import IMPLS, INTERPRET, KERNEL_IMPL, ON_GPU  # noqa: E402
from jax import lax  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import kq_jax  # noqa: E402
from kq_core.inputs import adversarial_inputs, router_inputs  # noqa: E402
from kq_core.oracle import route_shed_oracle  # noqa: E402



def layered_inputs(rng, layers=3, rows=5, top_k=8, experts=32):
    per_layer = [adversarial_inputs(rng, rows, top_k, experts, edge_fraction=0.1) for _ in range(layers)]
    ids, scores, tables = (np.stack(parts) for parts in zip(*per_layer))
    return ids, scores, tables  # [L, T, K], [L, T, K], [L, E]


def per_layer_oracle(ids, scores, tables):
    outs = [route_shed_oracle(i, s, t) for i, s, t in zip(ids, scores, tables)]
    return type(outs[0])(*(np.stack(parts) for parts in zip(*outs)))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_layers(impl, rng):
    ids, scores, tables = layered_inputs(rng)
    got = jax.jit(jax.vmap(lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl)))(ids, scores, tables)
    assert_same_bits(per_layer_oracle(ids, scores, tables), got)


@pytest.mark.parametrize("impl", IMPLS)
def test_scan_over_layers(impl, rng):
    ids, scores, tables = layered_inputs(rng)

    def layer(carry, xs):
        out = kq_jax.route_shed(*xs, impl=impl)
        return carry + jnp.sum(out.mix), out

    _, got = jax.jit(lambda xs: lax.scan(layer, jnp.float32(0), xs))((ids, scores, tables))
    assert_same_bits(per_layer_oracle(ids, scores, tables), got)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_with_leading_dims_and_uint32(impl, rng):
    ids, scores, table = router_inputs(rng, 12, 6, 40, index_dtype="uint32", score_dtype="bfloat16")
    ids, scores = ids.reshape(2, 6, 6), scores.reshape(2, 6, 6)
    got = jax.jit(lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl))(ids, scores, table)
    assert got.slots.dtype == jnp.uint32
    assert_same_bits(route_shed_oracle(ids, scores, table), got)


class RouteShedVariantsTest(chex.TestCase):
    """Both ops traced and untraced, each implementation: shapes and dtypes as documented, the oracle's bits."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_route_shed(self):
        ids, scores, table = adversarial_inputs(np.random.default_rng(5), 7, 6, 40, index_dtype="uint32")
        for impl in IMPLS:
            out = self.variant(functools.partial(kq_jax.route_shed, impl=impl))(ids, scores, table)
            chex.assert_shape(list(out), ids.shape)
            chex.assert_type(list(out), [jnp.uint32, jnp.float32, jnp.int32, jnp.float32])
            assert_same_bits(route_shed_oracle(ids, scores, table), out)

    @chex.variants(with_jit=True, without_jit=True)
    def test_topk_route_shed(self):
        from kq_core.oracle import topk_route_shed_oracle

        rng = np.random.default_rng(6)
        probs = rng.dirichlet(np.ones(32), size=(2, 3)).astype(np.float32)
        table = np.where(rng.random(32) < 0.5, rng.permutation(32), -1).astype(np.int32)
        for impl in IMPLS:
            out = self.variant(functools.partial(kq_jax.topk_route_shed, top_k=4, impl=impl))(probs, table)
            chex.assert_shape([out.indices, out.scores, *out.shed], (2, 3, 4))
            chex.assert_type([out.indices, out.scores], [jnp.int32, jnp.float32])
            assert_same_bits(topk_route_shed_oracle(probs, table, 4), out)


def _mix_loss(impl, ids, table, weights):
    return lambda s: jnp.sum(kq_jax.route_shed(ids, s, table, impl=impl).mix * weights)


@pytest.mark.parametrize("impl", IMPLS)
def test_mix_gradient_passes_check_grads(impl, rng):
    ids, scores, table = router_inputs(rng, 6, 8, 32, resident_fraction=0.6)
    weights = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
    modes = ["rev"] if impl.startswith("pallas") else ["fwd", "rev"]
    check_grads(_mix_loss(impl, ids, table, weights), (jnp.asarray(scores),), order=1, modes=modes,
                atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_mix_of_a_row_with_nothing_shed_passes_its_gradient_on_exactly_and_a_nan_row_gives_zeros(impl, rng):
    """Nothing shed: the mix is the scores, and so is its gradient, bit for bit. A row whose mass is NaN
    (its mix 0 but for the NaN entry) passes back zeros, not NaN to its other entries."""
    ids = jnp.asarray(np.array([[0, 1, 2], [0, 1, 2]], np.int32))
    table = jnp.asarray(np.array([2, 0, 1, -1], np.int32))
    scores = jnp.asarray(np.array([[0.3, 0.45, 0.25], [np.nan, 0.5, 0.25]], np.float32))
    weights = jnp.asarray(rng.normal(size=(2, 3)).astype(np.float32))
    grad = np.asarray(jax.grad(_mix_loss(impl, ids, table, weights))(scores))
    np.testing.assert_array_equal(grad[0].view(np.uint32), np.asarray(weights)[0].view(np.uint32))
    assert (grad[1] == 0).all()


@pytest.mark.parametrize("impl", [KERNEL_IMPL])
def test_kernel_gradient_matches_reference_within_one_ulp(impl, rng):
    ids, scores, table = router_inputs(rng, 64, 8, 64, resident_fraction=0.6)
    weights = jnp.asarray(rng.normal(size=ids.shape), jnp.float32)
    want = np.asarray(jax.jit(jax.grad(_mix_loss("reference", ids, table, weights)))(scores))
    got = np.asarray(jax.jit(jax.grad(_mix_loss(impl, ids, table, weights)))(scores))
    ulps = np.abs(want.view(np.int32).astype(np.int64) - got.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    assert np.abs(want).max() > 0  # the gradient is not trivially zero


@pytest.mark.parametrize("impl", IMPLS)
def test_integer_outputs_get_float0_cotangents(impl, rng):
    ids, scores, table = router_inputs(rng, 4, 8, 16)
    out, pullback = jax.vjp(lambda s: kq_jax.route_shed(ids, s, table, impl=impl), jnp.asarray(scores))
    cotangent = out._replace(
        slots=np.zeros(out.slots.shape, jax.dtypes.float0),
        miss_ids=np.zeros(out.miss_ids.shape, jax.dtypes.float0),
        mix=jnp.ones_like(out.mix),
        miss_scores=jnp.zeros_like(out.miss_scores),
    )
    (d_scores,) = pullback(cotangent)
    assert d_scores.shape == scores.shape and d_scores.dtype == jnp.float32


def test_exact_division_where_plain_division_is_approximate():
    total = kept = jnp.float32(3163.328613)
    out = kq_jax.route_shed(jnp.array([[0]], jnp.int32), jnp.array([[total]], jnp.float32),
                            jnp.array([0], jnp.int32))
    assert float(out.mix[0, 0]) == float(kept)  # scale is exactly 1.0


def test_auto_picks_the_kernel_on_a_gpu_and_the_reference_elsewhere():
    assert kq_jax.default_impl() == ("pallas" if ON_GPU else "reference")
    # Decode-sized calls run the reference everywhere (it fuses with the step around it on a GPU).
    assert kq_jax.default_impl(rows=1) == kq_jax.default_impl(rows=kq_jax.api.DECODE_ROWS) == "reference"
    assert kq_jax.default_impl(rows=kq_jax.api.DECODE_ROWS + 1) == ("pallas" if ON_GPU else "reference")


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl"):
        kq_jax.route_shed(np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32), np.zeros(2, np.int32),
                          impl="cuda")


@pytest.mark.parametrize("impl", IMPLS)
def test_shape_errors_raise_at_trace_time(impl):
    fn = jax.jit(lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl))
    with pytest.raises(ValueError, match="scores"):
        fn(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 3), jnp.float32), jnp.zeros(8, jnp.int32))
    with pytest.raises(TypeError, match="slot_table"):
        fn(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.float32), jnp.zeros(8, jnp.float32))


def test_kq_route_shed_dispatches_jax_arrays(rng):
    import kq

    ids, scores, table = router_inputs(rng, 3, 8, 32)
    out = kq.route_shed(jnp.asarray(ids), jnp.asarray(scores), jnp.asarray(table))
    assert isinstance(out.mix, jax.Array)
    assert_same_bits(route_shed_oracle(ids, scores, table), out)


@pytest.mark.parametrize("block_rows, num_warps, tiled_io", [(1, 1, False), (2, 1, False), (8, 2, False),
                                                       (1, 1, True), (8, 2, True)])
def test_pallas_launch_config_overrides_keep_the_bits(rng, block_rows, num_warps, tiled_io):
    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    inputs = adversarial_inputs(rng, 11, 6, 40)  # 11 rows: a ragged last block for every block size
    config = KernelConfig(block_rows, num_warps, tiled_io)
    got = jax.jit(lambda i, s, t: route_shed_pallas(i, s, t, interpret=INTERPRET, config=config))(*inputs)
    assert_same_bits(route_shed_oracle(*inputs), got)


gpu_only = pytest.mark.skipif(not ON_GPU, reason="inline PTX runs on a CUDA GPU only")
# The kernel's code paths, forced: the defaults on the tests' inputs mix them (block_config: entry lanes
# up to 8 rows and for K > 16, the strided row kernel up to 4096 rows, tiled I/O above), with PTX
# rounding on a CUDA GPU and integer rounding elsewhere.
VARIANTS = [
    pytest.param(dict(entry_lanes=False, tiled_io=False, ptx_arith=False), id="strided+integer"),
    pytest.param(dict(entry_lanes=False, tiled_io=False, ptx_arith=True), id="strided+ptx", marks=gpu_only),
    pytest.param(dict(tiled_io=True, ptx_arith=False), id="tiled+integer"),
    pytest.param(dict(tiled_io=True, ptx_arith=True), id="tiled+ptx", marks=gpu_only),
    pytest.param(dict(entry_lanes=True, ptx_arith=False), id="lanes+integer"),
    pytest.param(dict(entry_lanes=True, ptx_arith=True), id="lanes+ptx", marks=gpu_only),
]


def variant_takes(variant, top_k):
    from kq_jax.pallas_config import MAX_UNROLLED_K

    return not variant.get("tiled_io") or top_k <= MAX_UNROLLED_K


@pytest.mark.parametrize("variant", VARIANTS)
def test_pallas_variant_keeps_the_bits_on_every_golden_case(variant):
    from conftest import SPEC

    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    if ON_GPU and not variant["ptx_arith"]:
        pytest.skip("integer rounding on the golden cases: in Pallas' interpreter on the CPU (CI); on a GPU the "
                    "adversarial rows cover it, one compile per shape being the GPU run's cost")
    cases = [case for case in SPEC.cases if variant_takes(variant, case.inputs["indices"].shape[-1])]
    assert len(cases) >= 20
    for case in cases:
        got = route_shed_pallas(*case.inputs.values(), interpret=INTERPRET, config=KernelConfig(**variant),
                                **case.options)
        assert_same_bits(case.expected, got)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows, top_k, experts, index_dtype, score_dtype", [
    (37, 1, 3, "int32", "float32"), (70, 2, 64, "uint32", "bfloat16"), (33, 10, 128, "int32", "float16"),
    (65, 16, 4096, "uint32", "float32"), (40, 33, 256, "int32", "bfloat16"), (9, 64, 1024, "uint32", "float32")])
def test_pallas_variant_keeps_the_bits_on_adversarial_rows(rng, variant, rows, top_k, experts, index_dtype,
                                                           score_dtype):
    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    if not variant_takes(variant, top_k):
        pytest.skip("tiled I/O is for K <= MAX_UNROLLED_K")
    inputs = adversarial_inputs(rng, rows, top_k, experts, index_dtype=index_dtype, score_dtype=score_dtype)
    config = KernelConfig(block_rows=32, **variant)
    got = route_shed_pallas(*inputs, interpret=INTERPRET, config=config)
    assert_same_bits(route_shed_oracle(*inputs), got)


def test_pallas_entry_lanes_and_tiled_io_are_exclusive():
    from kq_jax.pallas_config import KernelConfig, block_config

    with pytest.raises(ValueError, match="entry_lanes"):
        block_config(100, 8, KernelConfig(tiled_io=True, entry_lanes=True))
    assert not block_config(8192, 8, KernelConfig(entry_lanes=True)).tiled_io


@gpu_only
def test_pallas_ptx_arith_keeps_the_bits_on_rounding_edges(rng):
    """Scales and products that round at ties, overflow, or land on and under 2**-126."""
    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    inputs = adversarial_inputs(rng, 20000, 8, 64, edge_fraction=0.5)
    got = jax.jit(lambda i, s, t: route_shed_pallas(i, s, t, config=KernelConfig(ptx_arith=True)))(*inputs)
    assert_same_bits(route_shed_oracle(*inputs), got)


def test_pallas_ptx_arith_is_refused_by_the_interpreter():
    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    with pytest.raises(ValueError, match="interpreter"):
        route_shed_pallas(*router_inputs(np.random.default_rng(0), 2, 8, 16), interpret=True,
                          config=KernelConfig(ptx_arith=True))


def test_pallas_default_path_follows_the_rows():
    from kq_jax.pallas_config import KernelConfig, block_config

    paths = {rows: block_config(rows, 8) for rows in (1, 8, 9, 4096, 4097)}
    assert [c.entry_lanes for c in paths.values()] == [True, True, False, False, False]
    assert [c.tiled_io for c in paths.values()] == [False, False, False, False, True]
    assert block_config(1, 17).entry_lanes and block_config(5000, 64).entry_lanes  # K > 16: every size
    assert not block_config(1, 8, KernelConfig(tiled_io=True)).entry_lanes


def test_pallas_tiled_io_is_for_k_up_to_16():
    from kq_jax.pallas_config import KernelConfig, block_config

    assert block_config(8192, 16).tiled_io and not block_config(8192, 17).tiled_io
    assert not block_config(4096, 8).tiled_io  # small grids: the strided kernel (see block_config)
    assert block_config(100, 16, KernelConfig(tiled_io=True)).tiled_io
    with pytest.raises(ValueError, match="K <= 16"):
        block_config(100, 17, KernelConfig(tiled_io=True))


def test_pallas_block_rows_must_be_a_power_of_two():
    from kq_jax.pallas_config import KernelConfig, block_config, topk_block_config

    with pytest.raises(ValueError, match="power of two"):
        block_config(100, 8, KernelConfig(block_rows=48))
    # 0 and a warp count of 0 were taken for "choose"; a dict read its fields as attributes
    for config, field in ((KernelConfig(block_rows=0), "block_rows"), (KernelConfig(block_rows=-4), "block_rows"),
                          (KernelConfig(num_warps=0), "num_warps"), (KernelConfig(num_warps=3), "num_warps"),
                          (KernelConfig(tiled_io="yes"), "tiled_io"), ({"block_rows": 4}, "config must be")):
        for resolve, op in ((block_config, "route_shed_pallas"), (topk_block_config, "topk_route_shed_pallas")):
            with pytest.raises(ValueError, match=f"{op}: (config.)?{field}"):
                resolve(100, 8, config)


def _run_op(op, impl, config, **options):
    """``op`` on one small row with ``impl`` and ``config``."""
    table = jnp.array([-1, -1, -1, 0, -1, -1, -1, 2, -1, -1], jnp.int32)
    if op == "route_shed":
        return kq_jax.route_shed(jnp.array([[7, 5, 3, 9]], jnp.int32), jnp.array([[.4, .3, .2, .1]], jnp.float32),
                                 table, impl=impl, config=config, **options)
    return kq_jax.topk_route_shed(jax.nn.softmax(jnp.arange(10.0)[None]), table, top_k=4, impl=impl, config=config,
                                  **options)


@pytest.mark.parametrize("op", ["route_shed", "topk_route_shed"])
@pytest.mark.parametrize("impl", ["auto", "reference", KERNEL_IMPL])
def test_a_config_that_is_no_kernel_config_is_refused_by_name(op, impl):
    with pytest.raises(ValueError, match=f"{op}: config must be a kq_jax.pallas_config.KernelConfig or None, got dict"):
        _run_op(op, impl, {"block_rows": 32})


@pytest.mark.parametrize("op, impl, options, message", [
    ("route_shed", "reference", {}, "impl 'reference' runs no kernel"),
    ("topk_route_shed", "reference", {}, "impl 'reference' runs no kernel"),
    pytest.param("route_shed", "auto", {}, "impl 'auto' chose the reference on the cpu backend, which runs no kernel",
                 marks=pytest.mark.skipif(ON_GPU, reason="'auto' with a config runs the kernel on a GPU")),
    ("topk_route_shed", "auto", {"normalize": False},
     "impl 'auto' chose the reference for normalize=False, on_miss='shed', which runs no kernel"),
], ids=["route_shed-reference", "topk-reference", "route_shed-auto-on-cpu", "topk-auto-unnormalized"])
def test_a_config_for_the_reference_says_which_impl_chose_it(op, impl, options, message):
    from kq_jax.pallas_config import KernelConfig

    with pytest.raises(ValueError, match=f"{op}: config sets the Pallas kernel's launch; {message}"):
        _run_op(op, impl, KernelConfig(block_rows=32), **options)


def test_jit_narrows_64_bit_inputs_before_the_op_sees_them(rng):
    """Defined, not refused: with 64-bit types off, jax.jit turns int64 ids and tables into int32 and float64
    scores into float32 (round to nearest) at its boundary, and the op runs on those; eagerly they are refused."""
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types are on: the op sees int64 and float64 and refuses them")
    indices, scores, table = router_inputs(rng, 64, 8, 32)
    wide = (indices.astype(np.int64) + (1 << 32), scores.astype(np.float64) * (1 + 2.0 ** -40),
            table.astype(np.int64))
    got = jax.jit(kq_jax.route_shed)(*wide)
    narrowed = (wide[0].astype(np.int32), wide[1].astype(np.float32), wide[2].astype(np.int32))
    assert (narrowed[0] == indices).all() and (narrowed[1] == scores).all()
    assert_same_bits(got, route_shed_oracle(*narrowed))
    with pytest.raises(TypeError, match="indices must have dtype"):
        kq_jax.route_shed(*wide)
