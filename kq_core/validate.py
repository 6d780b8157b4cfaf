"""Argument checks, run once at each public entry point of ``route_shed`` and ``topk_route_shed``.

Every input error is a :class:`RouteShedArgumentError` (a ``ValueError``) naming the
argument; a wrong dtype is a :class:`RouteShedDtypeError`, also a ``TypeError``. Two layers:

* :func:`check_route_shed_args` checks dtypes and shapes only. It reads
  ``.shape`` and ``.dtype`` and nothing else, so it runs at trace time in JAX
  and without evaluation in MLX. Every public entry point calls it.
* :func:`validate` checks the *values* a well-behaved router and arena
  produce. ``route_shed`` itself has a defined answer for every input, so this
  is a debugging aid for engines, not a precondition.
"""

from __future__ import annotations

import numbers
import operator

import numpy as np

from kq_core.contract import INDEX_DTYPES, MAX_TOP_K, ON_MISS, ROUTE_SHED_ON_MISS, SCORE_DTYPES, SLOT_TABLE_DTYPES


class RouteShedArgumentError(ValueError):
    """An argument of ``route_shed`` or ``topk_route_shed`` is not what the op takes: the one class of
    every input error kq raises (a ``ValueError``, as mlx_kquant's ``route_shed`` raises).

    Attributes:
        argument: name of the offending argument.
    """

    def __init__(self, argument: str, message: str):
        self.argument = argument
        super().__init__(message)


class RouteShedDtypeError(RouteShedArgumentError, TypeError):
    """An argument has the wrong dtype: a ``ValueError`` and a ``TypeError`` both."""


class RouteShedInputError(RouteShedArgumentError):
    """A value rule of :func:`validate` is broken.

    Attributes:
        argument: name of the offending argument.
        position: index tuple of the first offending element.
        rule: short name of the broken rule.
    """

    def __init__(self, argument: str, position: tuple[int, ...], rule: str, detail: str):
        self.position = position
        self.rule = rule
        super().__init__(argument, f"{argument}{list(position)}: {rule} ({detail})")


_DTYPE_NAMES: dict = {}  # dtype object -> name: a graph-building call names the same few dtypes again and again


def is_int(value) -> bool:
    """An int or a NumPy integer scalar, not a bool: the one test of every integer argument kq takes."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number, Python's or NumPy's (``numbers.Real``); not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_int_scalar(value) -> bool:
    """An integer scalar of any framework: an int, a NumPy integer, or a 0-d integer array (NumPy, JAX);
    not a bool."""
    if is_int(value):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or isinstance(value, np.bool_) or np.ndim(value) != 0:
        return False
    try:
        if np.dtype(dtype).kind not in "iu":
            return False
        operator.index(value)
    except TypeError:
        return False
    return True


def dtype_name(array) -> str:
    """Framework-neutral dtype name: 'int32', 'bfloat16', ... (NumPy, JAX, MLX)."""
    dtype = array.dtype
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype, named without the cache
        pass
    try:
        name = np.dtype(dtype).name
    except TypeError:
        # mlx.core.Dtype prints as 'mlx.core.int32'.
        name = str(dtype).rsplit(".", 1)[-1]
    try:
        _DTYPE_NAMES[dtype] = name
    except TypeError:
        pass
    return name


def _check_dtype(name: str, array, allowed: tuple[str, ...], op: str = "route_shed") -> None:
    if not (hasattr(array, "dtype") and hasattr(array, "shape")):
        raise RouteShedDtypeError(name, f"{op}: {name} must be an array (NumPy, JAX or MLX) of dtype "
                                        f"{' or '.join(allowed)}, got {type(array).__name__}; convert it with "
                                        f"np.asarray({name}, np.{allowed[0]})")
    got = dtype_name(array)
    if got not in allowed:
        raise RouteShedDtypeError(name, f"{op}: {name} must have dtype {' or '.join(allowed)}, got {got}")


def check_num_slots(num_slots, op: str = "route_shed") -> None:
    """``num_slots`` is None or an int in ``[1, 2**31 - 1]``; the error names ``op``."""
    if num_slots is not None and not (is_int(num_slots)
                                      and 1 <= num_slots <= np.iinfo(np.int32).max):
        raise RouteShedArgumentError("num_slots", f"{op}: num_slots must be None or an int in [1, 2**31 - 1], "
                                                  f"got {num_slots!r}")


def check_tier(op: str, on_miss: str, num_slots, num_experts: int) -> None:
    """``on_miss="tier"`` needs ``num_slots``, and ``num_slots + E`` must fit an int32 (the tier's slots)."""
    if on_miss != "tier":
        return
    if num_slots is None:
        raise RouteShedArgumentError("num_slots", f"{op}: on_miss='tier' needs num_slots, the arena's slot count "
                                                  f"(a miss's slot is num_slots + its id)")
    if num_slots + num_experts > np.iinfo(np.int32).max:
        raise RouteShedArgumentError("num_slots", f"{op}: with on_miss='tier', num_slots + E must be at most "
                                                  f"2**31 - 1, got {num_slots} + {num_experts}")


def check_route_shed_args(indices, scores, slot_table, num_slots=None, on_miss: str = "shed") -> None:
    """Raises :class:`RouteShedArgumentError` naming the argument on a wrong dtype, shape or option.

    Args:
        indices: ``[..., K]`` int32/uint32, ``1 <= K <= 64``.
        scores: same shape as ``indices``; float32, bfloat16 or float16.
        slot_table: ``[E]`` int32, ``E >= 1``.
        num_slots: None, or the arena's slot count S (an int >= 1); required with ``on_miss="tier"``.
        on_miss: one of :data:`~kq_core.contract.ROUTE_SHED_ON_MISS`.
    """
    check_num_slots(num_slots)
    if not isinstance(on_miss, str) or on_miss not in ROUTE_SHED_ON_MISS:
        raise RouteShedArgumentError("on_miss", f"route_shed: on_miss must be one of {ROUTE_SHED_ON_MISS}, "
                                                f"got {on_miss!r}")
    _check_dtype("indices", indices, INDEX_DTYPES)
    _check_dtype("scores", scores, SCORE_DTYPES)
    _check_dtype("slot_table", slot_table, SLOT_TABLE_DTYPES)
    ishape, sshape, tshape = tuple(indices.shape), tuple(scores.shape), tuple(slot_table.shape)
    if len(ishape) < 1:
        raise RouteShedArgumentError("indices", "route_shed: indices must have shape [..., K], got a scalar")
    if not 1 <= ishape[-1] <= MAX_TOP_K:
        raise RouteShedArgumentError("indices", f"route_shed: indices' last dim K must be in [1, {MAX_TOP_K}], "
                                                f"got shape {ishape}")
    if sshape != ishape:
        raise RouteShedArgumentError("scores", f"route_shed: scores must have the shape of indices {ishape}, "
                                               f"got {sshape}")
    if len(tshape) != 1:
        raise RouteShedArgumentError("slot_table", f"route_shed: slot_table must be 1-D [E], got shape {tshape}")
    if tshape[0] < 1:
        raise RouteShedArgumentError("slot_table", "route_shed: slot_table must hold at least one expert (E >= 1), "
                                                   "got E = 0")
    check_tier("route_shed", on_miss, num_slots, tshape[0])


def check_topk_route_shed_args(probs, slot_table, top_k: int, *, normalize: bool = True,
                               on_miss: str = "shed", num_slots=None) -> None:
    """:func:`check_route_shed_args` for ``topk_route_shed``, which routes as well.

    Args:
        probs: ``[..., E]`` float32/bfloat16/float16 router probabilities.
        slot_table: ``[E]`` int32.
        top_k: ``1 <= top_k <= min(E, 64)``.
        normalize: a bool.
        on_miss: one of :data:`~kq_core.contract.ON_MISS`.
        num_slots: None, or the arena's slot count S; required with ``on_miss="tier"``.
    """
    check_num_slots(num_slots, "topk_route_shed")
    if not isinstance(normalize, (bool, np.bool_)):
        raise RouteShedDtypeError("normalize", f"topk_route_shed: normalize must be a bool, got {normalize!r}")
    if not isinstance(on_miss, str) or on_miss not in ON_MISS:
        raise RouteShedArgumentError("on_miss", f"topk_route_shed: on_miss must be one of {ON_MISS}, got {on_miss!r}")
    _check_dtype("probs", probs, SCORE_DTYPES, "topk_route_shed")
    _check_dtype("slot_table", slot_table, SLOT_TABLE_DTYPES, "topk_route_shed")
    pshape, tshape = tuple(probs.shape), tuple(slot_table.shape)
    if len(pshape) < 1 or pshape[-1] < 1:
        raise RouteShedArgumentError("probs", f"topk_route_shed: probs must have shape [..., E] with E >= 1, "
                                              f"got {pshape}")
    if tshape != pshape[-1:]:
        raise RouteShedArgumentError("slot_table", f"topk_route_shed: slot_table must have shape [E] = "
                                                   f"{pshape[-1:]}, got {tshape}")
    if not (is_int(top_k)
            and 1 <= top_k <= min(pshape[-1], MAX_TOP_K)):
        raise RouteShedArgumentError("top_k", f"topk_route_shed: top_k must be an int in [1, min(E, {MAX_TOP_K})] "
                         f"with E = {pshape[-1]}, got {top_k!r}")
    check_tier("topk_route_shed", on_miss, num_slots, pshape[-1])


def _first(mask: np.ndarray) -> tuple[int, ...] | None:
    flat = np.flatnonzero(mask)
    if flat.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(flat[0], mask.shape))


def validate(indices, scores, slot_table, num_slots: int | None = None) -> None:
    """Checks that the inputs are what a top-k router and an arena produce.

    Rules, checked in this order, each reported at its first offending position
    (row-major): dtypes and shapes; every id in ``[0, E)``; no id twice in a
    row; every score finite and non-negative; every resident slot in
    ``[0, num_slots)`` (when ``num_slots`` is given); no two experts sharing a
    slot.

    Args:
        indices: ``[..., K]`` int32/uint32 router ids (host array).
        scores: ``[..., K]`` float32/bfloat16/float16 gate scores.
        slot_table: ``[E]`` int32 slot table, negative = not resident.
        num_slots: arena size S, if known.

    Raises:
        RouteShedInputError: a value rule is broken (a ``ValueError``).
        TypeError / ValueError: a dtype or shape is wrong.
    """
    check_route_shed_args(indices, scores, slot_table)
    indices, scores, slot_table = (np.asarray(a) for a in (indices, scores, slot_table))
    num_experts = slot_table.shape[0]
    ids = indices.astype(np.int64)

    where = _first((ids < 0) | (ids >= num_experts))
    if where is not None:
        raise RouteShedInputError("indices", where, "id out of range",
                                  f"id {ids[where]} not in [0, {num_experts})")

    rows = ids.reshape(-1, ids.shape[-1])
    order = np.argsort(rows, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(rows, order, axis=1)
    repeat = np.zeros(rows.shape, bool)
    np.put_along_axis(repeat, order[:, 1:], sorted_ids[:, 1:] == sorted_ids[:, :-1], axis=1)
    where = _first(repeat.reshape(ids.shape))
    if where is not None:
        raise RouteShedInputError("indices", where, "duplicate id in a row",
                                  f"id {ids[where]} appears earlier in the same row")

    values = scores.astype(np.float32)
    where = _first(~np.isfinite(values))
    if where is not None:
        raise RouteShedInputError("scores", where, "non-finite score", f"score {values[where]}")
    where = _first(values < 0)
    if where is not None:
        raise RouteShedInputError("scores", where, "negative score", f"score {values[where]}")

    resident = slot_table >= 0
    if num_slots is not None:
        where = _first(resident & (slot_table >= num_slots))
        if where is not None:
            raise RouteShedInputError("slot_table", where, "slot out of range",
                                      f"slot {slot_table[where]} not in [0, {num_slots})")

    experts = np.flatnonzero(resident)
    order = np.argsort(slot_table[experts], kind="stable")
    shared = slot_table[experts][order][1:] == slot_table[experts][order][:-1]
    if shared.any():
        second = experts[order[1:][shared]].min()
        raise RouteShedInputError("slot_table", (int(second),), "two experts share a slot",
                                  f"slot {slot_table[second]} is already held by another expert")
