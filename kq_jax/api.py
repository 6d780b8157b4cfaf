"""``kq_jax.route_shed``: one entry point over the Pallas kernel and the jnp reference."""

from __future__ import annotations

from typing import Literal

import jax

from kq.validate import check_route_shed_args, check_topk_route_shed_args
from kq_jax.reference import RouteShed, TopkRouteShed, route_shed_reference, topk_route_shed_reference

Impl = Literal["auto", "pallas", "pallas_interpret", "reference"]
IMPLS = ("auto", "pallas", "pallas_interpret", "reference")


def default_impl() -> str:
    """What ``impl="auto"`` runs.

    The compiled Pallas kernel on a GPU (faster than the reference at every
    benchmark shape, K = 64 included, on the H200 of docs/benchmarks.md), the
    jnp reference on every other backend. Both give the same bits.
    """
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _resolve(op: str, impl: str) -> str:
    """``impl`` checked, with ``"auto"`` replaced by :func:`default_impl`'s choice."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    return default_impl() if impl == "auto" else impl


def route_shed(indices, scores, slot_table, *, impl: Impl = "auto") -> RouteShed:
    """Remaps routed experts to arena slots and sheds the non-resident ones.

    Bit-exact with ``shared/spec.json`` on every backend. Traceable under
    ``jax.jit``, ``jax.vmap`` and ``lax.scan``; ``mix`` is differentiable with
    respect to ``scores``.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``; ``slot_table[e] >= 0`` is the arena slot of
            resident expert ``e``, negative means not resident.
        impl: ``"pallas"`` (the fused kernel, GPU), ``"pallas_interpret"``
            (the same kernel in Pallas' interpreter: any backend, slow),
            ``"reference"`` (pure jnp), or ``"auto"`` (:func:`default_impl`:
            the kernel on a GPU, else the reference).

    Returns:
        ``RouteShed(slots, mix, miss_ids, miss_scores)``, each shaped like
        ``indices``: ``slots`` in the dtype of ``indices``, ``mix`` float32,
        ``miss_ids`` int32 (front-packed, -1 padded), ``miss_scores`` float32.

    Raises:
        TypeError / ValueError: a wrong dtype or shape, naming the argument
            (at trace time under ``jax.jit``).
    """
    # Checked before anything converts: jnp.asarray would silently turn an
    # int64 NumPy array into int32 when x64 is off.
    check_route_shed_args(indices, scores, slot_table)
    impl = _resolve("route_shed", impl)
    if impl == "reference":
        return route_shed_reference(indices, scores, slot_table)
    from kq_jax.route_shed_pallas import route_shed_pallas

    return route_shed_pallas(indices, scores, slot_table, interpret=impl == "pallas_interpret")


def topk_route_shed(probs, slot_table, *, top_k: int, impl: Impl = "auto") -> TopkRouteShed:
    """Routes each row to its top-k experts, renormalises, and sheds the non-resident ones.

    ``route_shed(*topk(probs), slot_table)`` in one launch after the router's
    softmax (one fewer than ``lax.top_k`` then ``route_shed``, and no
    normalisation kernel between them): the op for a MoE layer on an arena at
    decode sizes. The order and normalisation are defined bit for bit in
    :mod:`kq.oracle`; on rows without NaN and without both signs of zero the
    order is ``lax.top_k``'s. :func:`kq_jax.reference.topk_normalized_ref`
    is the same two steps in jnp; a layer that keeps every expert can take
    ``lax.top_k`` and :func:`kq_jax.reference.normalize_topk_ref`, as
    ``kq_jax.moe.route`` does.

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities.
        slot_table: int32 ``[E]``; ``>= 0`` is the arena slot of a resident expert.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``; the fused kernel
            takes up to 16, past that the top-k runs in XLA before it.
        impl: as for :func:`route_shed`.

    Returns:
        ``TopkRouteShed(indices, scores, shed)``: int32 ids and float32
        renormalised scores ``[..., top_k]``, and ``route_shed`` of them.
        ``scores`` and ``shed.mix`` are differentiable with respect to ``probs``.
    """
    check_topk_route_shed_args(probs, slot_table, top_k)
    impl = _resolve("topk_route_shed", impl)
    if impl == "reference":
        return topk_route_shed_reference(probs, slot_table, top_k=top_k)
    from kq_jax.route_shed_pallas import topk_route_shed_pallas

    return topk_route_shed_pallas(probs, slot_table, top_k=top_k, interpret=impl == "pallas_interpret")
