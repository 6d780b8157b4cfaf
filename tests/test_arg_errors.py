"""Wrong shapes and dtypes raise a clear error naming the argument, in every public entry point."""

import numpy as np
import pytest

import kq
from kq.backends import Unavailable, all_backends

IDS = np.zeros((2, 4), np.int32)
SCORES = np.full((2, 4), 0.25, np.float32)
TABLE = np.arange(8, dtype=np.int32)

BAD = [
    ("k_over_64", (np.zeros((2, 65), np.int32), np.zeros((2, 65), np.float32), TABLE), ValueError, "indices"),
    ("k_zero", (np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32), TABLE), ValueError, "indices"),
    ("shape_mismatch", (IDS, np.zeros((2, 5), np.float32), TABLE), ValueError, "scores"),
    ("float_ids", (IDS.astype(np.float32), SCORES, TABLE), TypeError, "indices"),
    ("int64_ids", (IDS.astype(np.int64), SCORES, TABLE), TypeError, "indices"),
    ("float64_scores", (IDS, SCORES.astype(np.float64), TABLE), TypeError, "scores"),
    ("table_2d", (IDS, SCORES, TABLE.reshape(2, 4)), ValueError, "slot_table"),
    ("table_int64", (IDS, SCORES, TABLE.astype(np.int64)), TypeError, "slot_table"),
    ("table_empty", (IDS, SCORES, TABLE[:0]), ValueError, "slot_table"),
    ("scalar_ids", (np.int32(1), np.float32(1), TABLE), ValueError, "indices"),
]


def entry_points():
    yield "kq.route_shed", kq.route_shed
    yield "kq.validate", kq.validate
    for backend in all_backends():
        try:
            run, _ = backend.probe()
        except Unavailable:
            continue
        yield backend.name, run


@pytest.mark.parametrize("entry_name, entry", list(entry_points()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("case, args, error, argument", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_name_the_argument(entry_name, entry, case, args, error, argument):
    with pytest.raises(error, match=argument):
        entry(*args)


NOT_ARRAYS = [
    ("list_ids", (IDS.tolist(), SCORES, TABLE), "indices"),
    ("list_scores", (IDS, SCORES.tolist(), TABLE), "scores"),
    ("tuple_table", (IDS, SCORES, tuple(TABLE.tolist())), "slot_table"),
    ("int_table", (IDS, SCORES, 3), "slot_table"),
]


@pytest.mark.parametrize("entry_name, entry", list(entry_points()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("case, args, argument", NOT_ARRAYS, ids=[b[0] for b in NOT_ARRAYS])
def test_what_is_no_array_is_refused_naming_the_argument(entry_name, entry, case, args, argument):
    """Python lists and scalars are refused, not converted: their dtype (int64, float64) is not the op's."""
    with pytest.raises(TypeError, match=f"{argument} must be an array"):
        entry(*args)


def test_num_slots_works_on_numpy_arrays_as_on_every_framework():
    table = np.array([0, 5, 1, -1, 2, 3, 6, 4], np.int32)
    got = kq.route_shed(IDS + np.arange(4, dtype=np.int32), SCORES, table, num_slots=4)
    expected = kq.route_shed(IDS + np.arange(4, dtype=np.int32), SCORES, np.where(table < 4, table, -1))
    for a, b in zip(got, expected):
        assert a.tobytes() == b.tobytes()
    with pytest.raises(TypeError, match="takes only num_slots and on_miss, got \\['impl'\\]"):
        kq.route_shed(IDS, SCORES, TABLE, impl="pallas")


BAD_OPTIONS = [
    ("unknown_on_miss", {"on_miss": "drop"}, "on_miss"),
    ("on_miss_not_a_string", {"on_miss": ["tier"]}, "on_miss"),
    ("substitute_needs_probs", {"on_miss": "substitute"}, "on_miss"),
    ("tier_without_num_slots", {"on_miss": "tier"}, "num_slots"),
    ("tier_slots_past_int32", {"on_miss": "tier", "num_slots": 2**31 - 8}, "num_slots"),
]


@pytest.mark.parametrize("entry_name, entry", [e for e in entry_points() if e[0] != "kq.validate"],
                         ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("case, options, argument", BAD_OPTIONS, ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options_name_the_argument(entry_name, entry, case, options, argument):
    with pytest.raises(ValueError, match=argument):
        entry(IDS, SCORES, TABLE, **options)


def test_topk_route_shed_names_itself_for_a_bad_num_slots():
    kq_jax = pytest.importorskip("kq_jax")
    probs = np.full((1, 8), 1.0 / 8, np.float32)
    with pytest.raises(ValueError, match=r"^topk_route_shed: num_slots must be None or an int"):
        kq_jax.topk_route_shed(probs, TABLE, top_k=2, num_slots=0)


def test_route_shed_takes_the_framework_of_any_input():
    """NumPy indices beside JAX scores under jit go to JAX (the NumPy oracle cannot read a tracer); JAX and MLX
    arrays together are refused by name."""
    jax = pytest.importorskip("jax")
    got = jax.jit(lambda scores: kq.route_shed(IDS, scores, TABLE))(jax.numpy.asarray(SCORES))
    want = kq.route_shed(IDS, SCORES, TABLE)
    for a, b in zip(got, want):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    mx = pytest.importorskip("mlx.core")
    with pytest.raises(TypeError, match="route_shed: indices, scores and slot_table mix jax and mlx arrays"):
        kq.route_shed(jax.numpy.asarray(IDS), mx.array(SCORES), TABLE)
