"""topk_route_shed's options (normalize, on_miss) on every implementation against the oracle."""

import numpy as np
import pytest
from conftest import assert_same_bits

from kq_core.oracle import topk_route_shed_oracle


def _jax(probs, table, **options):
    pytest.importorskip("jax")
    import kq_jax

    return kq_jax.topk_route_shed(probs, table, **options)


def _mlx(probs, table, **options):
    mx = pytest.importorskip("mlx.core")
    import kq_mlx

    return kq_mlx.topk_route_shed(probs, table, stream=mx.cpu, **options)


def _numpy_result(result):
    return type(result)(np.array(result.indices), np.array(result.scores),
                        type(result.shed)(*(np.array(a) for a in result.shed)))


def edge_probs(rng, rows, experts):
    """Softmax rows and rows with ties, both zeros, NaN, infinities and subnormals."""
    probs = rng.dirichlet(np.full(experts, 0.3), rows).astype(np.float32)
    specials = np.array([np.nan, -0.0, 0.0, np.inf, 1e-40, 0.25, 0.25], np.float32)
    probs[0] = rng.choice(specials, experts)
    probs[1] = 0.125
    return probs


@pytest.mark.parametrize("implementation", [_jax, _mlx], ids=["jax-reference", "mlx-ops"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("on_miss", ["shed", "substitute", "tier"])
@pytest.mark.parametrize("experts, top_k, resident", [(8, 2, 0.5), (64, 8, 0.25), (40, 16, 0.6), (9, 9, 0.5),
                                                      (256, 64, 0.3), (16, 4, 0.0)])
def test_matches_the_oracle(implementation, normalize, on_miss, experts, top_k, resident):
    rng = np.random.default_rng(experts * 7 + top_k)
    probs = edge_probs(rng, 6, experts)
    table = np.where(rng.random(experts) < resident, rng.permutation(experts), -1).astype(np.int32)
    options = dict(normalize=normalize, on_miss=on_miss, num_slots=experts if on_miss == "tier" else None)
    want = topk_route_shed_oracle(probs, table, top_k, **options)
    got = implementation(probs, table, top_k=top_k, **options)
    assert_same_bits(want, _numpy_result(got))


def test_substitution_by_hand():
    probs = np.array([[0.4, 0.3, 0.2, 0.1, 0.0]], np.float32)  # top-2: experts 0, 1
    table = np.array([-1, 0, -1, 1, 2], np.int32)  # 1 -> slot 0; 3 -> slot 1; 4 -> slot 2; 0 and 2 not resident
    out = topk_route_shed_oracle(probs, table, 2, normalize=False, on_miss="substitute")
    # Expert 0 misses; the best resident expert not chosen is 3 (0.1 > 0.0), in slot 1, at expert 0's weight.
    assert out.indices.tolist() == [[0, 1]] and out.shed.slots.tolist() == [[1, 0]]
    np.testing.assert_array_equal(out.shed.mix, np.array([[0.4, 0.3]], np.float32))
    assert out.shed.miss_ids.tolist() == [[0, -1]]  # still reported for prestaging
    shed = topk_route_shed_oracle(probs, table, 2, normalize=False)
    np.testing.assert_allclose(shed.shed.mix, [[0.0, 0.7]], rtol=1e-6)  # route_shed keeps the routed mass


def test_tier_by_hand():
    probs = np.array([[0.4, 0.3, 0.2, 0.1, 0.0]], np.float32)  # top-3: experts 0, 1, 2
    table = np.array([-1, 0, -1, 1, 2], np.int32)  # 1 -> slot 0; 0 and 2 not resident
    out = topk_route_shed_oracle(probs, table, 3, normalize=False, on_miss="tier", num_slots=3)
    # Misses 0 and 2 go to the tier (slots 3 + 0 and 3 + 2) at their own weights; nothing is rescaled.
    assert out.shed.slots.tolist() == [[3, 0, 5]]
    np.testing.assert_array_equal(out.shed.mix, probs[:, :3])
    assert out.shed.miss_ids.tolist() == [[0, 2, -1]]


def test_tier_needs_num_slots_that_fit_int32():
    probs, table = np.ones((1, 4), np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="num_slots"):
        topk_route_shed_oracle(probs, table, 2, on_miss="tier")
    with pytest.raises(ValueError, match="num_slots"):
        topk_route_shed_oracle(probs, table, 2, on_miss="tier", num_slots=2**31 - 4)


def test_unknown_option_names_the_argument():
    with pytest.raises(ValueError, match="on_miss"):
        topk_route_shed_oracle(np.ones((1, 4), np.float32), np.zeros(4, np.int32), 2, on_miss="stall")
    with pytest.raises(TypeError, match="normalize"):
        topk_route_shed_oracle(np.ones((1, 4), np.float32), np.zeros(4, np.int32), 2, normalize="yes")


def test_the_kernel_refuses_options_it_does_not_implement():
    pytest.importorskip("jax")
    import kq_jax

    with pytest.raises(ValueError, match="implements normalize=True"):
        kq_jax.topk_route_shed(np.ones((1, 4), np.float32), np.zeros(4, np.int32), top_k=2, on_miss="substitute",
                               impl="pallas_interpret")


def test_dtype_errors_name_the_op_that_was_called():
    with pytest.raises(TypeError, match=r"^topk_route_shed: probs must have dtype"):
        topk_route_shed_oracle(np.ones((1, 4), np.float64), np.zeros(4, np.int32), 2)
    with pytest.raises(TypeError, match=r"^topk_route_shed: slot_table must have dtype"):
        topk_route_shed_oracle(np.ones((1, 4), np.float32), np.zeros(4, np.int64), 2)
