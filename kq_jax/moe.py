"""A jittable MoE feed-forward that runs on a bounded expert arena through ``route_shed``.

Routing follows Qwen3-MoE (softmax over experts, top-k, renormalised); experts
are SwiGLU (``down(silu(gate(x)) * up(x))``). :func:`moe_ffn_resident` is the
same layer with every expert in memory; with every expert resident in the
arena the two give identical bits, because ``route_shed`` keeps an all-kept
row's weights exactly (``scale`` is exactly 1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kq_jax.api import route_shed
from kq_jax.reference import RouteShed


class Experts(NamedTuple):
    """SwiGLU expert weights stacked over experts (or arena slots) on axis 0, in the
    checkpoint layout (``[out, in]`` per expert, as HF and mlx-lm store them).

    Attributes:
        gate: ``[N, F, D]``; up: ``[N, F, D]``; down: ``[N, D, F]``.
    """

    gate: jax.Array
    up: jax.Array
    down: jax.Array


class ArenaRouting(NamedTuple):
    """What one arena layer routed and shed; the host reads the misses from it after the step.

    Attributes:
        indices: int32 ``[T, k]``; scores: float32 ``[T, k]``; shed: ``route_shed``'s outputs.
    """

    indices: jax.Array
    scores: jax.Array
    shed: RouteShed


def route(x, router_w, *, top_k: int):
    """Softmax top-k routing, renormalised over the chosen k (Qwen3-MoE with norm_topk_prob).

    Args:
        x: ``[T, D]`` hidden states; router_w: ``[D, E]``.

    Returns:
        ``(indices int32 [T, k], scores float32 [T, k])``.
    """
    probs = jax.nn.softmax((x @ router_w).astype(jnp.float32), axis=-1)
    scores, indices = jax.lax.top_k(probs, top_k)
    return indices.astype(jnp.int32), scores / scores.sum(-1, keepdims=True)


def _experts_apply(x, experts: Experts, rows):  # x [T, D], rows [T, k] -> [T, k, D]
    gate = jnp.einsum("td,tkfd->tkf", x, experts.gate[rows])
    up = jnp.einsum("td,tkfd->tkf", x, experts.up[rows])
    return jnp.einsum("tkf,tkdf->tkd", jax.nn.silu(gate) * up, experts.down[rows])


def moe_ffn_resident(x, router_w, experts: Experts, *, top_k: int):
    """The MoE layer with all E experts in memory. x ``[T, D]`` -> ``[T, D]``."""
    indices, scores = route(x, router_w, top_k=top_k)
    y = _experts_apply(x, experts, indices)
    return jnp.einsum("tkd,tk->td", y, scores.astype(y.dtype))


def moe_ffn_arena(x, router_w, arena: Experts, slot_table, *, top_k: int, impl: str = "auto"):
    """The MoE layer on an arena of S slots.

    Args:
        x: ``[T, D]``; router_w: ``[D, E]``; arena: :class:`Experts` with ``N = S``;
        slot_table: int32 ``[E]`` (-1 = not resident); impl: ``route_shed``'s.

    Returns:
        ``(y [T, D], ArenaRouting)``: the output, and the routing and
        ``route_shed`` outputs the host reads after the step.
    """
    indices, scores = route(x, router_w, top_k=top_k)
    shed = route_shed(indices, scores, slot_table, impl=impl)
    y = _experts_apply(x, arena, shed.slots)
    return jnp.einsum("tkd,tk->td", y, shed.mix.astype(y.dtype)), ArenaRouting(indices, scores, shed)
