"""validate(): one error class, naming the argument, the first offending position and the rule."""

import ml_dtypes
import numpy as np
import pytest

from kq import RouteShedInputError, validate
from kq_core.validate import is_int, is_int_scalar, is_real

TABLE = np.array([0, 1, -1, 2, -1], np.int32)


def good():
    return np.array([[0, 1, 3], [1, 2, 4]], np.int32), np.array([[0.5, 0.3, 0.2]] * 2, np.float32), TABLE.copy()


def test_valid_inputs_pass():
    validate(*good(), num_slots=3)


@pytest.mark.parametrize("index_dtype", [np.int32, np.uint32])
def test_id_out_of_range(index_dtype):
    ids, scores, table = good()
    ids = ids.astype(np.int64)
    ids[1, 2] = 5
    with pytest.raises(RouteShedInputError) as info:
        validate(ids.astype(index_dtype), scores, table)
    assert (info.value.argument, info.value.position, info.value.rule) == ("indices", (1, 2), "id out of range")
    assert "indices[1, 2]" in str(info.value)


def test_negative_id():
    ids, scores, table = good()
    ids[0, 1] = -3
    with pytest.raises(RouteShedInputError, match=r"indices\[0, 1\]: id out of range"):
        validate(ids, scores, table)


def test_duplicate_id_reports_second_occurrence():
    ids, scores, table = good()
    ids[1] = [4, 2, 4]
    with pytest.raises(RouteShedInputError) as info:
        validate(ids, scores, table)
    assert (info.value.position, info.value.rule) == ((1, 2), "duplicate id in a row")


@pytest.mark.parametrize("bad, rule", [(np.nan, "non-finite score"), (np.inf, "non-finite score"),
                                       (-0.25, "negative score")])
def test_scores(bad, rule):
    ids, scores, table = good()
    scores[1, 1] = bad
    with pytest.raises(RouteShedInputError) as info:
        validate(ids, scores, table)
    assert (info.value.argument, info.value.position, info.value.rule) == ("scores", (1, 1), rule)


def test_bf16_scores_are_checked():
    ids, scores, table = good()
    scores[0, 0] = -1
    with pytest.raises(RouteShedInputError, match="negative score"):
        validate(ids, scores.astype(ml_dtypes.bfloat16), table)


def test_slot_outside_arena():
    ids, scores, table = good()
    with pytest.raises(RouteShedInputError) as info:
        validate(ids, scores, table, num_slots=2)
    assert (info.value.argument, info.value.position, info.value.rule) == ("slot_table", (3,), "slot out of range")


def test_two_experts_share_a_slot():
    ids, scores, table = good()
    table[4] = 1
    with pytest.raises(RouteShedInputError) as info:
        validate(ids, scores, table)
    assert (info.value.argument, info.value.position, info.value.rule) == ("slot_table", (4,), "two experts share a slot")


def test_error_is_a_value_error():
    assert issubclass(RouteShedInputError, ValueError)


INTEGERS = [("int", 3, True, True), ("numpy int64", np.int64(3), True, True),
            ("numpy uint64 max", np.uint64(2**64 - 1), True, True), ("0-d numpy array", np.array(3), False, True),
            ("bool", True, False, False), ("numpy bool", np.bool_(False), False, False),
            ("0-d bool array", np.array(True), False, False), ("float", 3.0, False, False),
            ("0-d float array", np.array(3.0), False, False), ("1-d array", np.array([3]), False, False),
            ("str", "3", False, False), ("None", None, False, False)]


@pytest.mark.parametrize("value,scalar_only,any_scalar", [row[1:] for row in INTEGERS], ids=[row[0] for row in INTEGERS])
def test_integer_checks(value, scalar_only, any_scalar):
    """is_int takes an int or NumPy integer; is_int_scalar a 0-d integer array too; neither a bool."""
    assert is_int(value) is scalar_only
    assert is_int_scalar(value) is any_scalar


def test_integer_scalar_of_other_frameworks():
    jnp = pytest.importorskip("jax.numpy")
    assert is_int_scalar(jnp.int32(4)) and not is_int(jnp.int32(4))
    assert not is_int_scalar(jnp.array([4])) and not is_int_scalar(jnp.array(True))


@pytest.mark.parametrize("value,real", [(1.5, True), (3, True), (np.float32(0.5), True), (np.int64(2), True),
                                        (float("nan"), True), (True, False), (np.bool_(True), False), ("1", False),
                                        (None, False), (np.array([1.0]), False), (1j, False)],
                         ids=["float", "int", "numpy float32", "numpy int64", "nan", "bool", "numpy bool", "str",
                              "None", "1-d array", "complex"])
def test_is_real(value, real):
    assert is_real(value) is real
