"""Qwen3-MoE decode steps whose MoE layers run on arenas (:func:`kq_jax.arena_moe.arena_moe`).

:func:`make_step` decodes one sequence through an arena of real slots; :func:`make_streams_step`
decodes B sequences side by side, each on a virtual arena of its own (a slot names the checkpoint's
expert it holds). Both return every layer's report packed in :mod:`kq_core.reports`' layout, and
:func:`record_routing_step` runs the model with every expert resident, returning what each layer
routed (and, with look-ahead, what the routers predicted for the next layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE
from kq_jax import qwen3_moe
from kq_jax.arena import pack_reports
from kq_jax.arena_moe import arena_moe, moe_layer
from kq_jax.moe import Experts, TierExperts, TierWeights, combine, experts_apply


def tier_arrays(tier) -> dict:
    """A :class:`kq_host.tier.Tier` as the steps' ``tier`` argument: ``{projection: (packed, scales, biases)}``
    ``[L, E, ...]`` on the device."""
    return {name: tuple(jnp.asarray(a) for a in weight) for name, weight in tier.weights.items()}


def _layer_tier(tier, layer: int, bits: int, group_size: int) -> TierExperts | None:
    if tier is None:
        return None
    return TierExperts(*(TierWeights(*(a[layer] for a in tier[name])) for name in qwen3_moe.PROJECTIONS),
                       bits=bits, group_size=group_size)


def _experts(p) -> Experts:
    return Experts(p["gate_proj"], p["up_proj"], p["down_proj"])


def make_step(cfg, rule: str, tier_options: tuple[int, int] = (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE)):
    """A jitted decode step under ``rule`` (any rule of :mod:`kq_core.rules`), each MoE layer
    :func:`kq_jax.arena_moe.moe_layer`: the step of :class:`kq_jax.nnx.ArenaMoE`, which runs the same layer
    under any rule but ``stall`` (every expert, from ``params`` here), so
    :class:`kq_jax.qwen3_moe_nnx.Qwen3MoeDecoder` gives this step's logits bit for bit.

    ``(params, arena, tables, token, position, cache, tier=None) -> (logits [1, V], cache, packed)``:
    ``arena`` ``{projection: [L, S, ...]}`` (None with rule ``stall``: every expert from ``params``),
    ``tables`` int32 ``[L, E]``, ``tier`` ``{projection: (packed, scales, biases)}`` ``[L, E, ...]`` for
    the tier rules, quantized with ``tier_options`` ``(bits, group_size)`` (default :mod:`kq_host.tier`'s);
    ``packed`` int32 ``[5, L, 1, k]`` (:mod:`kq_core.reports`).
    """
    bits, group_size = tier_options

    def step(params, arena, tables, token, position, cache, tier=None):
        def moe(layer, p, x):
            if rule == "stall" or arena is None:  # every routed expert served: the resident layer
                weights, num_slots, layer_rule = _experts(p), cfg.num_experts, "stall"
            else:
                weights = Experts(*(arena[name][layer] for name in qwen3_moe.PROJECTIONS))
                num_slots, layer_rule = weights.gate.shape[0], rule
            return moe_layer(x, p["router"].T, tables[layer], rule=layer_rule, top_k=cfg.num_experts_per_tok,
                             normalize=cfg.norm_topk_prob, weights=weights, num_slots=num_slots,
                             tier=_layer_tier(tier, layer, bits, group_size))

        logits, cache, reports = qwen3_moe.decode_step(params, token, position, cache, cfg, moe)
        return logits, cache, pack_reports(reports)

    return jax.jit(step)


def make_streams_step(cfg, rule: str, num_slots: int,
                      tier_options: tuple[int, int] = (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE)):
    """:func:`make_step` for B streams side by side, each with its own arena of ``num_slots`` per layer:
    ``(params, tables [L, B, E], tokens [B], position, cache, tier=None) -> (logits [B, V], cache,
    packed int32 [5, L, B, k])``.

    The arenas are virtual: a slot holds the checkpoint's expert as it is, so the step reads an arena
    slot's weights from ``params``' one copy of the experts, through the expert the stream's slot table
    put there. What is resident, hit, shed or served from the tier is each stream's own.
    """
    bits, group_size = tier_options

    def step(params, tables, tokens, position, cache, tier=None):
        def moe(layer, p, x):
            low = _layer_tier(tier, layer, bits, group_size)

            def row(x, table):  # one stream: x [D], table [E]
                x = x[None]
                indices, scores, probs = qwen3_moe.route_layer(p, x, cfg)
                experts = jnp.arange(cfg.num_experts, dtype=jnp.int32)
                slot_expert = jnp.zeros(num_slots, jnp.int32).at[jnp.where(table >= 0, table, num_slots)].set(
                    experts, mode="drop")  # which expert each slot holds
                out, report = arena_moe(x, indices, scores, table, rule=rule, weights=_experts(p),
                                        num_slots=num_slots, tier=low, probs=probs,
                                        slot_rows=None if rule == "stall" else slot_expert,
                                        normalize=cfg.norm_topk_prob)
                return out[0], tuple(field[0] for field in report)

            return jax.vmap(row)(x, tables[layer])

        return qwen3_moe.decode_step(params, tokens, position, cache, cfg, moe)

    step, pack = jax.jit(step), jax.jit(pack_reports)

    def packed_step(*args):  # packed by a program of its own, the step's program left as it was
        logits, cache, reports = step(*args)
        return logits, cache, pack(reports)

    return packed_step


def resident_moe(cfg):
    """The MoE layer with every expert in memory, recording its routing: ``moe(layer, p, x) -> (out,
    (indices, scores))``, for :func:`kq_jax.qwen3_moe.decode_step`."""
    def moe(layer, p, x):
        indices, scores, _ = qwen3_moe.route_layer(p, x, cfg)
        return combine(experts_apply(x, _experts(p), indices), scores), (indices, scores)

    return moe

