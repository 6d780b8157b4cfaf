"""The baseline a JAX user writes without kq: plain jnp, not bit-exact (for ``kq bench`` only)."""

from __future__ import annotations

import jax.numpy as jnp

from kq_core.contract import RouteShedResult


def route_shed_naive(indices, scores, slot_table) -> RouteShedResult:  # [rows, k] each
    """Gather, reductions and ``argsort``: the obvious jnp version of route_shed."""
    num_experts = slot_table.shape[0]
    ids = indices.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    slot = jnp.where(valid, slot_table[jnp.clip(ids, 0, num_experts - 1)], -1)
    keep = slot >= 0
    s = scores.astype(jnp.float32)
    total = s.sum(-1, keepdims=True)
    kept = jnp.where(keep, s, 0.0).sum(-1, keepdims=True)
    mix = jnp.where(keep, s * jnp.where(kept > 0, total / kept, 0.0), 0.0)
    first = jnp.take_along_axis(slot, jnp.argmax(keep, -1, keepdims=True), -1)
    slots = jnp.where(keep, slot, jnp.maximum(first, 0))
    miss = valid & ~keep
    order = jnp.argsort(jnp.where(miss, -s, jnp.inf), axis=-1)
    filled = jnp.arange(ids.shape[-1]) < miss.sum(-1, keepdims=True)
    miss_ids = jnp.where(filled, jnp.take_along_axis(ids, order, -1), -1)
    miss_scores = jnp.where(filled, jnp.take_along_axis(s, order, -1), 0.0)
    return RouteShedResult(slots.astype(indices.dtype), mix, miss_ids, miss_scores)
