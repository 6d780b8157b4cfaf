"""A jittable MoE feed-forward that runs on a bounded expert arena through ``route_shed``.

Routing follows Qwen3-MoE (softmax over experts, top-k, renormalised); experts
are SwiGLU (``down(silu(gate(x)) * up(x))``). :func:`moe_ffn_resident` is the
same layer with every expert in memory; with every expert resident in the
arena the two give identical bits: both take the top-k and renormalise it as
:mod:`kq_core.oracle` defines (the arena layer in ``topk_route_shed``'s one
launch, the resident one with ``lax.top_k`` and the same arithmetic in XLA),
and ``route_shed`` keeps an all-kept row's weights exactly (``scale`` is
exactly 1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kq_core.contract import TopkRouteShedResult
from kq_jax.api import topk_route_shed
from kq_jax.reference import normalize_topk_ref


class Experts(NamedTuple):
    """SwiGLU expert weights stacked over experts (or arena slots) on axis 0, in the
    checkpoint layout (``[out, in]`` per expert, as HF and mlx-lm store them).

    Attributes:
        gate: ``[N, F, D]``; up: ``[N, F, D]``; down: ``[N, D, F]``.
    """

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def router_probs(x, router_w):
    """Softmax over experts in float32. x ``[T, D]``, router_w ``[D, E]`` -> ``[T, E]``."""
    return jax.nn.softmax((x @ router_w).astype(jnp.float32), axis=-1)


def route(x, router_w, *, top_k: int):
    """Softmax top-k routing, renormalised over the chosen k (Qwen3-MoE with norm_topk_prob).

    ``lax.top_k``, then ``topk_route_shed``'s renormalisation (a sequential
    sum, a correctly rounded division) instead of XLA's approximate GPU
    division, so the resident and the arena layer route alike on every
    backend: softmax probabilities hold no NaN and no -0.0, where alone the
    two top-k orders differ.

    Args:
        x: ``[T, D]`` hidden states; router_w: ``[D, E]``.

    Returns:
        ``(indices int32 [T, k], scores float32 [T, k])``.
    """
    raw, indices = lax.top_k(router_probs(x, router_w), top_k)
    return indices, normalize_topk_ref(raw)


def experts_apply(x, experts: Experts, rows):
    """Each token's k experts on it: x ``[T, D]``, rows ``[T, k]`` slot ids -> ``[T, k, D]``."""
    gate = jnp.einsum("td,tkfd->tkf", x, experts.gate[rows])
    up = jnp.einsum("td,tkfd->tkf", x, experts.up[rows])
    return jnp.einsum("tkf,tkdf->tkd", jax.nn.silu(gate) * up, experts.down[rows])


def moe_ffn_resident(x, router_w, experts: Experts, *, top_k: int):
    """The MoE layer with all E experts in memory. x ``[T, D]`` -> ``[T, D]``."""
    indices, scores = route(x, router_w, top_k=top_k)
    y = experts_apply(x, experts, indices)
    return jnp.einsum("tkd,tk->td", y, scores.astype(y.dtype))


def moe_ffn_arena(x, router_w, arena: Experts, slot_table, *, top_k: int, impl: str = "auto"):
    """The MoE layer on an arena of S slots.

    Args:
        x: ``[T, D]``; router_w: ``[D, E]``; arena: :class:`Experts` with ``N = S``;
        slot_table: int32 ``[E]`` (-1 = not resident); impl: ``topk_route_shed``'s.

    Returns:
        ``(y [T, D], TopkRouteShedResult)``: the output, and the routing and
        ``route_shed`` outputs the host reads after the step.
    """
    # num_slots: a table entry past the arena is shed, never gathered (jnp.take would clamp it).
    routing: TopkRouteShedResult = topk_route_shed(router_probs(x, router_w), slot_table, top_k=top_k,
                                                   num_slots=arena.gate.shape[0], impl=impl)
    y = experts_apply(x, arena, routing.shed.slots)
    return jnp.einsum("tkd,tk->td", y, routing.shed.mix.astype(y.dtype)), routing
