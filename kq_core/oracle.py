"""The executable definition of ``route_shed``: a NumPy oracle.

Every backend in this project is tested bit for bit against this module and
against the golden vectors in ``shared/spec.json`` that it generates.

The contract, per row of ``K`` routed experts (all arithmetic in IEEE-754
binary32, round to nearest even, in exactly this order):

1. ``s_k = flush(f32(scores_k))``; ``flush(x)`` maps every ``|x| < 2**-126``
   (subnormals and -0.0) to +0.0. Upcasting bf16/f16 to f32 is exact.
2. ``e_k = indices_k`` as a signed 64-bit integer (a uint32 id >= 2**31 is out
   of range). ``valid_k = 0 <= e_k < E``; ``slot_k = slot_table[e_k]`` if valid,
   else -1; with ``num_slots`` given, a ``slot_k >= num_slots`` is -1 too (an
   entry the arena cannot hold is not resident). Entry k is *kept* iff
   ``slot_k >= 0``.
3. ``total = kept = 0.0``; for k = 0..K-1: ``total = flush(total + s_k)``; if
   kept, ``kept = flush(kept + s_k)``. Sequential: no tree reduction, no FMA.
4. ``scale = flush(total / kept)`` (correctly rounded) if ``kept > 0.0`` else 0.0.
5. kept entries: ``slots_k = slot_k``, ``mix_k = flush(s_k * scale)``; shed
   entries: ``slots_k`` = slot of the row's first kept entry (0 if none),
   ``mix_k = +0.0``.
6. Misses (shed and valid) are front-packed into ``miss_ids`` / ``miss_scores``
   (the id and ``s_k``) by descending ``s_k``, NaN below every number, ties by
   lower k; the remaining positions hold -1 and +0.0.
7. Every NaN written to ``mix`` or ``miss_scores`` is 0x7FC00000.
8. With ``on_miss="tier"`` (``num_slots = S`` required) a miss is served by
   the low-precision tier, which holds every expert, instead of being shed:
   every valid entry keeps its score, ``mix_k = s_k`` (steps 3-4 unused:
   nothing is rescaled), and a miss's ``slots_k = S + e_k``, its place after
   the arena's S slots in one index space over arena and tier. An invalid
   entry is as in step 5 (the first kept slot, ``mix_k = +0.0``), and the
   misses are reported as in step 6, for prestaging.

``topk_route_shed(probs, slot_table, top_k, normalize=True, on_miss="shed")``
routes as well, so a MoE layer on an arena needs one launch after its
softmax. Per row of ``E`` values:

1. ``v_e = f32(probs_e)``. The entries are ranked by descending ``v_e`` in a
   total order: +0.0 above -0.0, NaN (any payload) below every number, ties
   by lower ``e``; ``indices`` holds the first ``top_k`` (int32). On rows
   without NaN and without both signs of zero this is ``lax.top_k``'s order.
2. ``r_j = flush(v[indices_j])``. With ``normalize`` (a router with
   ``norm_topk_prob``): ``total = 0.0``; for j = 0..top_k-1:
   ``total = flush(total + r_j)``; ``scores_j = flush(r_j / total)``,
   correctly rounded (IEEE for 0/0 and x/0). Without: ``scores_j = r_j``.
   Every NaN 0x7FC00000.
3. ``shed = route_shed(indices, scores, slot_table)``.
4. With ``on_miss="substitute"``, each miss is served by a resident stand-in
   instead of being shed: the row's candidates are the experts with
   ``slot_table[e] >= 0`` that are not among its ``indices``, in step 1's
   order; the j-th miss in k order takes the j-th candidate, if there is one.
   Then every entry served (kept, or given a candidate) has ``mix_j =
   scores_j`` (not rescaled: the routed mass is served in full), a
   substituted entry's ``slots_j`` is its candidate's slot, and an entry left
   without a candidate keeps ``shed``'s slot with ``mix_j = +0.0``.
   ``miss_ids`` / ``miss_scores`` still list the misses, for prestaging.
   With ``on_miss="tier"``, step 3 is ``route_shed``'s step 8.
"""

from __future__ import annotations

import numpy as np

from kq_core.contract import (
    CANONICAL_NAN_BITS,
    F32_MIN_NORMAL,
    NAN_ORDER_KEY,
    RouteShedResult,
    TopkRouteShedResult,
)
from kq_core.validate import check_route_shed_args, check_topk_route_shed_args


def flush(x: np.ndarray) -> np.ndarray:
    """Maps every float32 with magnitude below 2**-126 (and -0.0) to +0.0."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.float32(F32_MIN_NORMAL), np.float32(0.0), x).astype(np.float32)


def canonicalize_nan(x: np.ndarray) -> np.ndarray:
    """Replaces every NaN (any sign or payload) by the quiet NaN 0x7FC00000."""
    return np.where(np.isnan(x), np.uint32(CANONICAL_NAN_BITS).view(np.float32), x)


def route_shed_oracle(indices, scores, slot_table, *, num_slots: int | None = None,
                      on_miss: str = "shed") -> RouteShedResult:
    """Remaps routed experts to arena slots, sheds the non-resident ones.

    This is the reference definition of the op (see the module docstring for
    the exact contract). It is vectorised across rows only, which cannot change
    a bit: within a row every f32 operation happens in contract order.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k expert ids.
        scores: float32, bfloat16 or float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``; ``slot_table[e] >= 0`` is the slot of a
            resident expert e, any negative value means not resident.
        num_slots: the arena's slot count S; a table entry outside ``[0, S)``
            then counts as not resident (shed, a miss if the id is valid), so no
            gather after the op can read past the arena. None: no bound.
        on_miss: ``"shed"``, or ``"tier"`` (step 8: a miss keeps its score
            and gets slot ``num_slots + id``, served by the low-precision tier;
            needs ``num_slots``).

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)``, each shaped
        like ``indices``; ``slots`` has the dtype of ``indices``, ``mix`` and
        ``miss_scores`` are float32, ``miss_ids`` is int32.

    Raises:
        TypeError / ValueError: a wrong dtype, shape or option, naming the argument.
    """
    check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
    indices, scores, slot_table = np.asarray(indices), np.asarray(scores), np.asarray(slot_table)
    return _route_shed(indices, scores, bounded_table(slot_table, num_slots),
                       tier_base=num_slots if on_miss == "tier" else None)


def bounded_table(slot_table: np.ndarray, num_slots: int | None) -> np.ndarray:
    """The table with every entry ``>= num_slots`` made -1 (not resident); as it is without ``num_slots``."""
    return slot_table if num_slots is None else np.where(slot_table >= num_slots, -1, slot_table).astype(np.int32)


def _route_shed(indices: np.ndarray, scores: np.ndarray, slot_table: np.ndarray,
                tier_base: int | None = None) -> RouteShedResult:
    """Steps 1-7; with ``tier_base`` (= S), step 8 instead of the rescaling."""
    out_shape = indices.shape
    top_k = out_shape[-1]
    ids = indices.reshape(-1, top_k).astype(np.int64)  # [rows, k]
    s = flush(scores.reshape(-1, top_k).astype(np.float32))  # [rows, k]
    num_experts = slot_table.shape[0]

    valid = (ids >= 0) & (ids < num_experts)
    slot = np.where(valid, slot_table[np.where(valid, ids, 0)], -1).astype(np.int64)
    keep = slot >= 0

    rows = ids.shape[0]
    total = np.zeros(rows, np.float32)
    kept = np.zeros(rows, np.float32)
    # Overflow to inf and inf - inf are part of the contract, not accidents.
    with np.errstate(all="ignore"):
        for k in range(top_k):
            total = flush(total + s[:, k])
            kept = np.where(keep[:, k], flush(kept + s[:, k]), kept)
        has_mass = kept > np.float32(0.0)
        quotient = flush(total / np.where(has_mass, kept, np.float32(1.0)))
        scale = np.where(has_mass, quotient, np.float32(0.0))
        mix = np.where(keep, flush(s * scale[:, None]), np.float32(0.0))

    any_kept = keep.any(axis=1)
    first_kept = np.argmax(keep, axis=1)
    fallback = np.where(any_kept, slot[np.arange(rows), first_kept], 0)
    slots = np.where(keep, slot, fallback[:, None])

    miss = valid & ~keep
    if tier_base is not None:
        slots = np.where(miss, tier_base + ids, slots)
        mix = np.where(valid, s, np.float32(0.0))
    is_nan = np.isnan(s)
    neg_score = np.where(is_nan, np.float32(0.0), -s)
    position = np.broadcast_to(np.arange(top_k), ids.shape)
    # lexsort's last key is the primary one: misses first, numbers before NaN,
    # descending score, then ascending k.
    order = np.lexsort((position, neg_score, is_nan, ~miss), axis=-1)
    packed_ids = np.take_along_axis(ids, order, axis=1)
    packed_scores = np.take_along_axis(s, order, axis=1)
    filled = position < miss.sum(axis=1, keepdims=True)
    miss_ids = np.where(filled, packed_ids, -1)
    miss_scores = np.where(filled, packed_scores, np.float32(0.0))

    return RouteShedResult(
        slots=slots.astype(indices.dtype).reshape(out_shape),
        mix=canonicalize_nan(mix.astype(np.float32)).reshape(out_shape),
        miss_ids=miss_ids.astype(np.int32).reshape(out_shape),
        miss_scores=canonicalize_nan(miss_scores.astype(np.float32)).reshape(out_shape),
    )


def score_order_key(values: np.ndarray) -> np.ndarray:
    """int32 key whose ascending order is descending f32 ``values``, +0.0 before -0.0, NaN last."""
    bits = np.asarray(values, np.float32).view(np.int32)
    monotone = np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return np.where(np.isnan(values), np.int32(NAN_ORDER_KEY), -monotone).astype(np.int32)


def topk_normalized_oracle(probs, top_k: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1 and 2 of ``topk_route_shed``: ``(indices int32 [..., k], scores float32 [..., k])``."""
    values = np.asarray(probs).astype(np.float32)
    out_shape = values.shape[:-1] + (top_k,)
    values = values.reshape(-1, values.shape[-1])  # [rows, E]
    order = np.argsort(score_order_key(values), axis=1, kind="stable")[:, :top_k]
    scores = flush(np.take_along_axis(values, order, axis=1))
    if normalize:
        total = np.zeros(scores.shape[0], np.float32)
        with np.errstate(all="ignore"):
            for j in range(top_k):
                total = flush(total + scores[:, j])
            scores = flush(scores / total[:, None])
    return order.astype(np.int32).reshape(out_shape), canonicalize_nan(scores).reshape(out_shape)


def _substitute(probs: np.ndarray, indices: np.ndarray, scores: np.ndarray, slot_table: np.ndarray,
                shed: RouteShedResult) -> RouteShedResult:
    """Step 4: misses served by the best resident experts the row did not choose."""
    num_experts, top_k = slot_table.shape[0], indices.shape[-1]
    values = np.asarray(probs).astype(np.float32).reshape(-1, num_experts)
    ids = indices.reshape(-1, top_k)
    rows = ids.shape[0]
    order = np.argsort(score_order_key(values), axis=1, kind="stable")  # [rows, E], best first
    chosen = np.zeros((rows, num_experts), bool)
    np.put_along_axis(chosen, ids, True, axis=1)
    eligible = np.take_along_axis((slot_table >= 0)[None, :] & ~chosen, order, axis=1)
    # The first top_k eligible experts in order: a stable sort puts eligible positions first.
    firsts = np.argsort(~eligible, axis=1, kind="stable")[:, :top_k]
    candidates = np.where(np.take_along_axis(eligible, firsts, axis=1),
                          np.take_along_axis(order, firsts, axis=1), -1)  # [rows, top_k], -1: none
    slots, mix = shed.slots.reshape(-1, top_k), np.zeros((rows, top_k), np.float32)
    kept = slot_table[ids] >= 0
    rank = np.cumsum(~kept, axis=1) - 1
    candidate = np.take_along_axis(candidates, np.clip(rank, 0, top_k - 1), axis=1)
    found = ~kept & (candidate >= 0)
    s = scores.reshape(-1, top_k)
    slots = np.where(found, slot_table[np.maximum(candidate, 0)].astype(slots.dtype), slots)
    mix = np.where(kept | found, s, np.float32(0.0))
    return shed._replace(slots=slots.reshape(indices.shape), mix=mix.reshape(indices.shape))


def topk_route_shed_oracle(probs, slot_table, top_k: int, *, normalize: bool = True,
                           on_miss: str = "shed", num_slots: int | None = None) -> TopkRouteShedResult:
    """Routes each row to its top-k experts and sheds the non-resident ones (module docstring).

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities.
        slot_table: int32 ``[E]``; ``>= 0`` is the slot of a resident expert.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``.
        normalize: renormalise the top-k values to sum to 1 (routers with
            ``norm_topk_prob``); otherwise they are the scores as they are.
        on_miss: ``"shed"`` (``route_shed``), ``"substitute"``: each miss
            served by the best resident expert the row did not choose (step 4),
            or ``"tier"``: each miss served by the low-precision tier
            (``route_shed``'s step 8; needs ``num_slots``).
        num_slots: as for :func:`route_shed_oracle` (substitutes too are taken
            only from entries inside the arena).

    Returns:
        ``TopkRouteShedResult(indices, scores, shed)``, shaped ``[..., top_k]``.
    """
    check_topk_route_shed_args(probs, slot_table, top_k, normalize=normalize, on_miss=on_miss, num_slots=num_slots)
    probs, slot_table = np.asarray(probs), np.asarray(slot_table)
    slot_table = bounded_table(slot_table, num_slots)
    indices, scores = topk_normalized_oracle(probs, top_k, normalize)
    shed = _route_shed(indices, scores, slot_table, tier_base=num_slots if on_miss == "tier" else None)
    if on_miss == "substitute":
        shed = _substitute(probs, indices, scores, slot_table, shed)
    return TopkRouteShedResult(indices, scores, shed)
