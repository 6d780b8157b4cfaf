"""``route_shed`` in pure ``jax.numpy``: the reference the Pallas kernel is held to.

Traceable under ``jax.jit``, ``jax.vmap`` and ``lax.scan``; bit-exact with
``shared/spec.json`` on every XLA backend because the two rounded operations
go through :mod:`kq_jax.ieee_f32` and every other step is an exact select,
compare or a sequential add followed by the contract's flush. ``mix`` is
differentiable with respect to ``scores``. The functions here trust their
arguments: :mod:`kq_jax.api` checks them once, at the public entry point.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kq_core.contract import (
    NAN_ORDER_KEY,
    NOT_A_MISS_KEY,
    RouteShedResult,
    TopkRouteShedResult,
)
from kq_jax.ieee_f32 import canonicalize_nan, div_flush, flush, mul_flush
from kq_jax.partition import rowwise


@functools.partial(rowwise, num_row_args=1, num_tables=0)
def _top_k_keys(keys, top_k):
    # lax.top_k on integer order keys, kept row-sharded: XLA's own partitioning
    # of top_k gathers every row onto every device on the CPU.
    return lax.top_k(keys, top_k)


def lookup_slots(ids, slot_table):
    """Arena slot per id, -1 for ids outside [0, E) (uint32 ids >= 2**31 included).

    Args:
        ids: int32/uint32 ``[rows, k]``.
        slot_table: int32 ``[E]``.

    Returns:
        ``(slot int32 [rows, k], valid bool [rows, k])``.
    """
    num_experts = slot_table.shape[0]
    if ids.dtype == jnp.uint32:
        valid = ids < jnp.uint32(num_experts)
    else:
        valid = (ids >= 0) & (ids < num_experts)
    safe = jnp.where(valid, ids, 0).astype(jnp.int32)
    return jnp.where(valid, slot_table[safe], -1), valid


def score_order_key(s):
    """int32 key whose ascending order is descending ``s``, +0.0 before -0.0, NaN last."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    monotone = jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return jnp.where(jnp.isnan(s), NAN_ORDER_KEY, -monotone)


def score_from_order_key(key):
    """The f32 whose :func:`score_order_key` is ``key`` (the canonical NaN for NaN's key)."""
    monotone = -key
    bits = jnp.where(monotone >= 0, monotone, monotone ^ 0x7FFFFFFF)
    return canonicalize_nan(jnp.where(key == NAN_ORDER_KEY, jnp.nan, lax.bitcast_convert_type(bits, jnp.float32)))


def bounded_table(slot_table, num_slots: int | None):
    """The table with every entry ``>= num_slots`` made -1 (not resident); as it is without ``num_slots``."""
    slot_table = jnp.asarray(slot_table)
    return slot_table if num_slots is None else jnp.where(slot_table >= num_slots, -1, slot_table)


def _mix_scale(s, keep):
    """``(scale, kept)`` of each row: its total mass over its kept mass, summed in top-k order (0 where
    nothing with mass is kept)."""
    total = jnp.zeros(s.shape[:1], jnp.float32)
    kept = jnp.zeros(s.shape[:1], jnp.float32)
    for k in range(s.shape[1]):
        total = flush(total + s[:, k])
        kept = jnp.where(keep[:, k], flush(kept + s[:, k]), kept)
    has_mass = kept > 0.0
    return jnp.where(has_mass, div_flush(total, jnp.where(has_mass, kept, 1.0)), 0.0), kept


@jax.custom_jvp
def _kept_mix(s, keep):
    """The kept entries' weights ``[rows, k]``: each kept score times its row's total / kept mass, 0 shed."""
    scale, _ = _mix_scale(s, keep)
    return jnp.where(keep, mul_flush(s, scale[:, None]), 0.0)


@_kept_mix.defjvp
def _kept_mix_jvp(primals, tangents):
    # d scale / d s_i = (1 - scale * keep_i) / kept: one sum whose weights are exactly 0 when nothing is
    # shed (scale 1), so the mix's gradient is then the scores' own, bit for bit (written as d total / kept -
    # scale * d kept / kept, the two terms cancel only up to rounding).
    s, keep = primals
    ds, _ = tangents
    scale, kept = _mix_scale(s, keep)
    weights = jnp.where(kept[:, None] > 0.0, (1.0 - scale[:, None] * keep) / jnp.where(kept > 0.0, kept, 1.0)[:, None],
                        0.0)
    d_scale = jnp.sum(weights * ds, axis=1)
    mix = jnp.where(keep, mul_flush(s, scale[:, None]), 0.0)
    finite = jnp.where(jnp.isfinite(s), s, 0.0)  # a NaN score's row: its other entries' derivatives stay 0
    return mix, jnp.where(keep, ds * scale[:, None] + finite * d_scale[:, None], 0.0)


def route_shed_ref(indices, scores, slot_table, num_slots: int | None = None,
                   on_miss: str = "shed") -> RouteShedResult:
    """Remaps routed experts to arena slots and sheds the non-resident ones (or serves them from the tier).

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``; ``>= 0`` is the slot of a resident expert.
        num_slots: entries ``>= num_slots`` count as not resident (None: no bound).
        on_miss: ``"shed"``, or ``"tier"``: a miss keeps its score, at slot ``num_slots + id``.

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)`` shaped like ``indices``.
    """
    indices, scores = jnp.asarray(indices), jnp.asarray(scores)
    slot_table = bounded_table(slot_table, num_slots)
    out_shape = indices.shape
    top_k = out_shape[-1]
    ids = indices.reshape(-1, top_k)  # [rows, k]
    s = flush(scores.reshape(-1, top_k).astype(jnp.float32))  # [rows, k]

    slot, valid = lookup_slots(ids, slot_table)
    keep = slot >= 0

    mix = _kept_mix(s, keep)

    first_kept = jnp.argmax(keep, axis=1)
    fallback = jnp.where(keep.any(axis=1), jnp.take_along_axis(slot, first_kept[:, None], axis=1)[:, 0], 0)
    slots = jnp.where(keep, slot, fallback[:, None])

    miss = valid & ~keep
    if on_miss == "tier":
        slots = jnp.where(miss, num_slots + ids.astype(jnp.int32), slots)
        mix = jnp.where(valid, s, 0.0)
    position = lax.broadcasted_iota(jnp.int32, ids.shape, 1)
    key = jnp.where(miss, score_order_key(s), NOT_A_MISS_KEY)
    _, _, packed_ids, packed_scores = lax.sort(
        (key, position, ids.astype(jnp.int32), lax.stop_gradient(s)), dimension=1, num_keys=2)
    filled = position < miss.sum(axis=1, keepdims=True)
    miss_ids = jnp.where(filled, packed_ids, -1)
    miss_scores = jnp.where(filled, packed_scores, 0.0)

    return RouteShedResult(
        slots=slots.astype(indices.dtype).reshape(out_shape),
        mix=canonicalize_nan(mix).reshape(out_shape),
        miss_ids=miss_ids.reshape(out_shape),
        miss_scores=canonicalize_nan(miss_scores).reshape(out_shape),
    )



def topk_ref(probs, *, top_k: int):
    """Each row's ``top_k`` largest values, in the contract's total order (kq_core.oracle).

    The order is taken on integer keys, so NaN and the two zeros land where
    the contract puts them on every backend. On rows without NaN and without
    both signs of zero it is ``lax.top_k``'s: descending, ties by lower index
    (``tests/test_topk_route_shed.py`` checks that on softmax rows with ties,
    zeros and subnormals).

    Args:
        probs: float ``[..., E]``.

    Returns:
        ``(indices int32 [..., k], values float32 [..., k])``.
    """
    values = jnp.asarray(probs).astype(jnp.float32)
    _, indices = _top_k_keys(-score_order_key(lax.stop_gradient(values)), top_k)
    return indices, jnp.take_along_axis(values, indices, axis=-1)


def normalize_topk_ref(raw):
    """``flush(r_j / total)`` with ``total`` the flushed sequential sum of the flushed ``r_j``.

    Args:
        raw: float32 ``[..., k]`` top-k values.

    Returns:
        float32 ``[..., k]``, every NaN canonical. Differentiable.
    """
    raw = flush(raw)
    total = jnp.zeros(raw.shape[:-1], jnp.float32)
    for j in range(raw.shape[-1]):
        total = flush(total + raw[..., j])
    return canonicalize_nan(div_flush(raw, total[..., None]))


def topk_normalized_ref(probs, *, top_k: int, normalize: bool = True):
    """:func:`topk_ref` then :func:`normalize_topk_ref` (or only the flush, without ``normalize``):
    ``(indices int32 [..., k], scores float32 [..., k])``."""
    indices, raw = topk_ref(probs, top_k=top_k)
    return indices, normalize_topk_ref(raw) if normalize else canonicalize_nan(flush(raw))


def substitute_ref(probs, indices, scores, slot_table, shed: RouteShedResult) -> RouteShedResult:
    """``topk_route_shed``'s ``on_miss="substitute"`` (kq_core.oracle, step 4) applied to ``shed``.

    Args:
        probs: float ``[..., E]``; indices, scores: ``[..., k]`` from :func:`topk_normalized_ref`;
        slot_table: int32 ``[E]``; shed: ``route_shed_ref(indices, scores, slot_table)``.
    """
    values = jnp.asarray(probs).astype(jnp.float32)
    top_k = indices.shape[-1]
    chosen = jnp.any(indices[..., :, None] == jnp.arange(values.shape[-1]), axis=-2)
    eligible = (slot_table >= 0) & ~chosen
    # lax.top_k of the negated order keys: best first, ties by lower expert id; the ineligible sink.
    never = jnp.iinfo(jnp.int32).min
    best, candidates = _top_k_keys(jnp.where(eligible, -score_order_key(lax.stop_gradient(values)), never), top_k)
    kept = slot_table[indices] >= 0
    rank = jnp.clip(jnp.cumsum(~kept, axis=-1) - 1, 0, top_k - 1)
    candidate = jnp.take_along_axis(candidates, rank, axis=-1)
    found = ~kept & (jnp.take_along_axis(best, rank, axis=-1) != never)
    slots = jnp.where(found, slot_table[candidate].astype(shed.slots.dtype), shed.slots)
    return shed._replace(slots=slots, mix=jnp.where(kept | found, scores, 0.0))


def topk_route_shed_ref(probs, slot_table, *, top_k: int, normalize: bool = True, on_miss: str = "shed",
                        num_slots: int | None = None) -> TopkRouteShedResult:
    """Routes each row to its top-k experts, renormalises, and sheds (or substitutes) the non-resident ones.

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities.
        slot_table: int32 ``[E]``; ``>= 0`` is the slot of a resident expert.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``.
        normalize, on_miss, num_slots: as for ``kq_jax.topk_route_shed``.

    Returns:
        ``TopkRouteShedResult(indices, scores, shed)``, each array ``[..., top_k]``.
    """
    slot_table = bounded_table(slot_table, num_slots)
    indices, scores = topk_normalized_ref(probs, top_k=top_k, normalize=normalize)
    shed = route_shed_ref(indices, scores, slot_table, num_slots, on_miss="tier" if on_miss == "tier" else "shed")
    if on_miss == "substitute":
        shed = substitute_ref(probs, indices, scores, slot_table, shed)
    return TopkRouteShedResult(indices, scores, shed)
