"""``route_shed`` for a graph compiled at fixed shapes (``mx.compile`` without ``shapeless``) on a CPU stream.

The same contract and bits as :func:`kq_mlx.route_shed_ops`, in fewer primitives: that form moves the
row's entries by masked reductions (about 2 K + 7 of them a call, each a task of its own on MLX's CPU
stream, which costs a decode step more than the experts do). Here :func:`serve` gives what a layer's
experts need (``slots`` and ``mix``) from a gather, two cumulative sums (scores known >= 0) or a chain
over the columns (any scores) and one integer minimum, and :func:`rank_misses` ranks the misses with
one sort of unique int64 keys, so one call can rank every layer's rows of a token at once. The columns,
the slices and the bit views fix the shape: a compile around them is traced per shape (a decode step's
one row, a prompt's length). :func:`mix_all_kept` is compiled on any stream (a resident layer's weights).
Over zero rows MLX 0.32.4's CUDA backend aborts a compiled graph of these functions (SIGFPE,
docs/benchmarks.md); no model pass gets there, as mlx-lm's models refuse a pass of no tokens.
"""

from __future__ import annotations

import mlx.core as mx

from kq_core.contract import RouteShedResult
from kq_mlx import sources
from kq_mlx.route_shed_mlx import canonical_nan, flush_subnormals


# Positions in a row's sort key: K <= 64 (kq_core.contract).
_POSITIONS = 64


def _columns(x: mx.array, axis: int = -1) -> list[mx.array]:
    """``x``'s entries along ``axis``, each kept as an axis of length one."""
    count = x.shape[axis]
    return [x] if count == 1 else mx.split(x, count, axis=axis)


def _flushed_scores(scores: mx.array) -> mx.array:
    return flush_subnormals(scores.astype(mx.float32))


def _validity(ids: mx.array, num_experts: int) -> mx.array:
    if ids.dtype == mx.uint32:
        return ids < mx.array(num_experts, mx.uint32)
    return (ids >= 0) & (ids < num_experts)


def serve(indices: mx.array, scores: mx.array, slot_table: mx.array, *, num_slots: int | None = None,
          on_miss: str = "shed", nonnegative: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """What a layer's experts need of ``route_shed`` (its ``slots`` and ``mix``), and which entries missed.

    With ``nonnegative`` the caller knows every score is >= 0 or NaN (a softmax router's): the running
    sums are then each one cumulative sum, left to right as the contract orders them (MLX's CPU scan adds
    in order), with no flush between: the scores are flushed first, so each is +0.0 or at least the
    smallest normal, and no partial sum of such numbers is subnormal; the flush after every addition
    changes nothing. A negative score there gives the bits of sums without those flushes.

    Args:
        indices: uint32 or int32 ``[..., K]``; scores: float ``[..., K]``; slot_table: int32 ``[E]``;
            num_slots, on_miss: as :func:`kq_mlx.route_shed`.
        nonnegative: the scores are known to be >= 0 or NaN.

    Returns:
        ``(slots, mix, miss)``: :func:`kq_mlx.route_shed`'s ``slots`` (``indices``' dtype) and ``mix``
        (float32), and bool ``[..., K]``, the routed entries whose expert is not resident, the input of
        :func:`rank_misses`.
    """
    tier_base = sources.tier_base(num_slots, on_miss)
    top_k = indices.shape[-1]
    s = _flushed_scores(scores)
    valid = _validity(indices, slot_table.shape[0])
    safe = mx.where(valid, indices, 0).astype(mx.int32)
    # The table bounded after the gather (K entries a row, not E): the same entries as bounding it first.
    slot = mx.where(valid, slot_table[safe], -1)
    keep = (slot >= 0) if num_slots is None else (slot >= 0) & (slot < int(num_slots))
    position = mx.arange(top_k, dtype=mx.int32)
    kept_s = mx.where(keep, s, 0.0)

    # The contract's running sums, left to right, flushed after every addition: [..., 1].
    if nonnegative:
        total = mx.cumsum(s, axis=-1)[..., -1:]
        kept = mx.cumsum(kept_s, axis=-1)[..., -1:]
    else:
        total = kept = mx.array(0.0, mx.float32)
        for score, kept_score in zip(_columns(s), _columns(kept_s)):
            total = flush_subnormals(total + score)
            kept = flush_subnormals(kept + kept_score)
    has_mass = kept > 0.0
    scale = mx.where(has_mass, flush_subnormals(total / mx.where(has_mass, kept, 1.0)), 0.0)
    mix = mx.where(keep, flush_subnormals(s * scale), 0.0)

    # A shed entry takes the row's first kept slot (0 where none is kept). Integer reductions: exact in any order.
    if num_slots is not None and top_k * int(num_slots) < 2**31:
        # One minimum over position * S + slot: the first kept entry, and its slot the remainder.
        past = top_k * int(num_slots)
        first = mx.min(mx.where(keep, position * int(num_slots) + slot, past), axis=-1, keepdims=True)
        slots = mx.where(keep, slot, mx.where(first < past, first % int(num_slots), 0))
    else:
        first_kept = mx.min(mx.where(keep, position, top_k - 1), axis=-1, keepdims=True)
        slot_first_kept = mx.sum(mx.where((position == first_kept) & keep, slot, 0), axis=-1, keepdims=True)
        slots = mx.where(keep, slot, mx.where(mx.any(keep, axis=-1, keepdims=True), slot_first_kept, 0))
    miss = valid & ~keep
    if tier_base is not None:  # on_miss="tier": a miss at slot S + id, every served entry at its score
        slots = mx.where(miss, tier_base + safe, slots)
        mix = mx.where(valid, s, 0.0)
    return slots.astype(indices.dtype), canonical_nan(mix), miss


def mix_all_kept(scores: mx.array, *, on_miss: str = "shed") -> mx.array:
    """:func:`serve`'s ``mix`` (with ``nonnegative``) for rows whose every entry is valid and resident: the
    same operations with every entry kept, so the same bits, without the table, the ids or the slots.

    Args:
        scores: float ``[..., K]``, each >= 0 or NaN (a softmax router's, or positive constants).
        on_miss: ``"shed"`` (the kept weights rescaled to the row's mass, which is then a no-op but for the
            flush and NaN rules) or ``"tier"`` (each entry at its own flushed score).

    Returns:
        float32 ``[..., K]``.
    """
    s = _flushed_scores(scores)
    if on_miss == "tier":
        return canonical_nan(s)
    total = mx.cumsum(s, axis=-1)[..., -1:]  # the kept mass too: every entry is kept
    has_mass = total > 0.0
    scale = mx.where(has_mass, flush_subnormals(total / mx.where(has_mass, total, 1.0)), 0.0)
    return canonical_nan(flush_subnormals(s * scale))


def rank_misses(indices: mx.array, scores: mx.array, miss: mx.array) -> tuple[mx.array, mx.array]:
    """``route_shed``'s prestage list from :func:`serve`'s ``miss``: the misses, highest score first (NaN
    after every number, ties by position), padded with -1 and 0.0.

    Each entry gets one int64 key, unique in its row (the position is its lowest bits), ordered as the
    contract orders the entries (misses with a number by descending score, then NaN misses, then the
    rest, each by position), so one sort of the keys gives the order whatever the sort's stability. Row-wise,
    so the rows of every layer of a token can go in one call (stacked ``[L, T, K]``).

    Args:
        indices: uint32 or int32 ``[..., K]``; scores: float ``[..., K]``; miss: bool ``[..., K]``.

    Returns:
        ``(miss_ids int32 [..., K], miss_scores float32 [..., K])``.
    """
    top_k = indices.shape[-1]
    s = _flushed_scores(scores)
    position = mx.arange(top_k, dtype=mx.int64)
    group = mx.where(miss, mx.where(mx.isnan(s), 1, 0), 2).astype(mx.int64)  # 0: a number, 1: NaN, 2: no miss
    bits = s.view(mx.int32)
    monotone = mx.where(bits >= 0, bits, mx.bitwise_xor(bits, 0x7FFFFFFF)).astype(mx.int64)  # ordered as s
    descending = mx.where(group == 0, (2**31 - 1) - monotone, 0)  # in [0, 2**32)
    key = (group * 2**32 + descending) * _POSITIONS + position
    order = mx.argsort(key, axis=-1)
    filled = mx.arange(top_k, dtype=mx.int32) < mx.sum(miss.astype(mx.int32), axis=-1, keepdims=True)
    miss_ids = mx.where(filled, mx.take_along_axis(indices.astype(mx.int32), order, axis=-1), -1)
    miss_scores = mx.where(filled, mx.take_along_axis(s, order, axis=-1), 0.0)
    return miss_ids, canonical_nan(miss_scores)


def route_shed_columns(indices: mx.array, scores: mx.array, slot_table: mx.array, *, num_slots: int | None = None,
                       on_miss: str = "shed") -> RouteShedResult:
    """``route_shed`` in a fixed-shape graph: :func:`serve`, then :func:`rank_misses`; the arguments and
    outputs of :func:`kq_mlx.route_shed`, unchecked (the caller's arrays are the arena's own: the
    router's ids and scores, the published table). Builds the graph and evaluates nothing."""
    slots, mix, miss = serve(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    return RouteShedResult(slots, mix, *rank_misses(indices, scores, miss))
