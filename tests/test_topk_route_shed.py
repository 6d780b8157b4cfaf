"""topk_route_shed (the router's top-k, its renormalisation and route_shed in one op) against the NumPy oracle."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from conftest import assert_same_bits  # noqa: E402
from jax_impls import IMPLS, KERNEL_IMPL  # noqa: E402
from jax import lax  # noqa: E402

import kq_jax  # noqa: E402
from kq_core.oracle import route_shed_oracle, topk_route_shed_oracle  # noqa: E402
from kq_jax.reference import topk_ref  # noqa: E402

NAN = np.float32(np.nan)
TINY = np.float32(1e-40)  # subnormal


def router_probs(rng, rows, experts, *, spread=40.0):
    """Softmax of wide logits, as a random router gives (zero and subnormal probabilities
    among the top-k at large E), the first rows replaced by edge rows where there is room:
    all tied, a few tied levels, both zeros with NaN and infinities, only subnormals (total 0),
    overflowing values (total inf), negatives."""
    logits = rng.normal(size=(rows, experts)).astype(np.float32) * spread
    probs = np.array(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    specials = np.array([NAN, -0.0, 0.0, np.inf, -np.inf, TINY, -TINY, -1.5, 0.25], np.float32)
    edges = [
        np.full(experts, 0.5, np.float32),
        np.round(probs[0] * 3) / 4 + 0.25,
        rng.choice(specials, experts),
        np.where(rng.random(experts) < 0.5, TINY, 0.0).astype(np.float32),
        np.full(experts, 3e38, np.float32) * rng.random(experts, np.float32),
        -rng.random(experts, np.float32),
    ]
    for row, edge in zip(range(rows), edges):
        probs[row] = edge
    return probs


def slot_table(rng, experts, resident_fraction):
    resident = rng.random(experts) < resident_fraction
    return np.where(resident, rng.permutation(experts), -1).astype(np.int32)


# (rows, E, top_k, resident fraction): decode and prefill rows, E a power of two and not, top_k from 1
# to E, and past the fused kernel's 16 (XLA top-k, then the route_shed kernel).
CASES = [(1, 8, 2, 0.5), (3, 64, 8, 1.0), (9, 256, 8, 0.25), (6, 40, 16, 0.5), (4, 7, 7, 0.6),
         (2, 64, 20, 0.5), (17, 32, 1, 0.3), (40, 16, 4, 0.0)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows, experts, top_k, resident_fraction", CASES,
                         ids=[f"{r}x{e}-k{k}-res{f}" for r, e, k, f in CASES])
def test_matches_the_oracle(impl, rows, experts, top_k, resident_fraction, rng):
    probs = router_probs(rng, rows, experts)
    table = slot_table(rng, experts, resident_fraction)
    got = jax.jit(lambda p, t: kq_jax.topk_route_shed(p, t, top_k=top_k, impl=impl))(probs, table)
    assert_same_bits(topk_route_shed_oracle(probs, table, top_k), got)


TIER_CASES = [(3, 64, 8, 0.5, 48), (9, 40, 16, 0.25, 40), (2, 64, 20, 0.5, 64), (6, 16, 4, 0.0, 4)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows, experts, top_k, resident_fraction, num_slots", TIER_CASES,
                         ids=[f"{r}x{e}-k{k}-res{f}-s{s}" for r, e, k, f, s in TIER_CASES])
def test_tier_matches_the_oracle(impl, rows, experts, top_k, resident_fraction, num_slots, rng):
    probs = router_probs(rng, rows, experts)
    table = slot_table(rng, experts, resident_fraction)
    options = dict(on_miss="tier", num_slots=num_slots)
    got = jax.jit(lambda p, t: kq_jax.topk_route_shed(p, t, top_k=top_k, impl=impl, **options))(probs, table)
    assert_same_bits(topk_route_shed_oracle(probs, table, top_k, **options), got)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_probs_with_leading_dims(impl, rng):
    probs = router_probs(rng, 12, 32).reshape(2, 6, 32).astype(jnp.bfloat16)
    table = slot_table(rng, 32, 0.5)
    got = jax.jit(lambda p, t: kq_jax.topk_route_shed(p, t, top_k=6, impl=impl))(probs, table)
    assert got.indices.shape == (2, 6, 6)
    assert_same_bits(topk_route_shed_oracle(probs, table, 6), got)


def test_the_contract_by_hand():
    probs = np.array([[0.1, 0.4, 0.4, 0.1], [NAN, -0.0, 0.0, -1.0]], np.float32)
    table = np.array([0, -1, 1, 2], np.int32)  # expert 1 not resident
    out = topk_route_shed_oracle(probs, table, 3)
    # Ties go to the lower index; +0.0 ranks above -0.0, NaN below every number.
    np.testing.assert_array_equal(out.indices, [[1, 2, 0], [2, 1, 3]])
    total = (np.float32(0.4) + np.float32(0.4)) + np.float32(0.1)
    np.testing.assert_array_equal(out.scores[0], np.array([0.4, 0.4, 0.1], np.float32) / total)
    # 0/total and -0.0 flushed to +0.0 and divided: zeros; -1/-1 = 1.
    np.testing.assert_array_equal(out.scores[1].view(np.uint32), np.array([0.0, 0.0, 1.0], np.float32).view(np.uint32))
    expected_shed = route_shed_oracle(out.indices, out.scores, table)
    assert_same_bits(expected_shed, out.shed)
    np.testing.assert_array_equal(out.shed.miss_ids[0], [1, -1, -1])


@pytest.mark.parametrize("experts, top_k", [(64, 8), (256, 8), (128, 1), (256, 64)])
def test_order_is_lax_top_k_on_rows_without_nan_or_signed_zeros(experts, top_k, rng):
    logits = rng.normal(size=(64, experts)).astype(np.float32) * 3
    logits[:16] = np.round(logits[:16])  # ties
    logits[16:32] *= 30  # zero probabilities among the top k
    probs = np.array(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    probs[32:48] *= np.float32(2.0**-127)  # subnormals (XLA's CPU softmax flushes them, a GPU's need not)
    assert ((probs > 0) & (probs < 2.0**-126)).any()
    ours, _ = jax.jit(lambda p: topk_ref(p, top_k=top_k))(probs)
    _, theirs = jax.jit(lambda p: lax.top_k(p, top_k))(probs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _loss(impl, table, top_k, weights):
    def loss(p):
        routed = kq_jax.topk_route_shed(p, table, top_k=top_k, impl=impl)
        return jnp.sum(routed.shed.mix * weights) + jnp.sum(routed.scores * weights[::-1])

    return loss


@pytest.mark.parametrize("impl", [KERNEL_IMPL])
def test_kernel_gradient_matches_reference_within_one_ulp(impl, rng):
    probs = router_probs(rng, 16, 32, spread=2.0)[6:]  # the finite rows
    table = slot_table(rng, 32, 0.5)
    weights = jnp.asarray(rng.normal(size=(probs.shape[0], 4)), jnp.float32)
    want = np.asarray(jax.jit(jax.grad(_loss("reference", table, 4, weights)))(probs))
    got = np.asarray(jax.jit(jax.grad(_loss(impl, table, 4, weights)))(probs))
    ulps = np.abs(want.view(np.int32).astype(np.int64) - got.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    assert np.count_nonzero(want) >= probs.shape[0] * 2  # several routed entries per row carry gradient


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_layers(impl, rng):
    probs = np.stack([router_probs(rng, 5, 32) for _ in range(3)])  # [L, T, E]
    tables = np.stack([slot_table(rng, 32, 0.5) for _ in range(3)])  # [L, E]
    got = jax.jit(jax.vmap(lambda p, t: kq_jax.topk_route_shed(p, t, top_k=4, impl=impl)))(probs, tables)
    for layer in range(3):
        assert_same_bits(topk_route_shed_oracle(probs[layer], tables[layer], 4),
                           jax.tree.map(lambda a: a[layer], got))


@pytest.mark.parametrize("probs, table, top_k, message", [
    (np.zeros((2, 8), np.float32), np.zeros(8, np.int32), 9, "top_k"),
    (np.zeros((2, 8), np.float32), np.zeros(8, np.int32), 0, "top_k"),
    (np.zeros((2, 8), np.float32), np.zeros(7, np.int32), 2, "slot_table"),
    (np.zeros((2, 8), np.int32), np.zeros(8, np.int32), 2, "probs"),
    (np.zeros((2, 8), np.float32), np.zeros(8, np.int64), 2, "slot_table"),
], ids=["top_k-above-E", "top_k-zero", "table-not-E", "int-probs", "int64-table"])
@pytest.mark.parametrize("impl", IMPLS)
def test_argument_errors_name_the_argument(impl, probs, table, top_k, message):
    with pytest.raises((TypeError, ValueError), match=message):
        kq_jax.topk_route_shed(probs, table, top_k=top_k, impl=impl)
