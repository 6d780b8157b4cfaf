"""One MoE layer's step on an arena, written once: route_shed, the rule, the experts, the combine, the report.

Every decode loop of kq in JAX (the study's steps, the end-to-end benchmark's engine, the demo's stack, the
exact loop, the tier benchmark, :class:`kq_jax.nnx.ArenaMoE`, :func:`kq_jax.arena_moe.moe_ffn_arena` and
:func:`~kq_jax.arena_moe.moe_ffn_tiered`) runs a layer through :func:`arena_moe` with its own routing and
weights, so how JAX does what a rule says with a miss, how hits and tier copies are gathered and how the
entries are combined is written here alone; what each rule means is :mod:`kq_core.rules`'.

Rules for a routed expert that is not resident (:data:`RULES`): the names and meanings of
:mod:`kq_core.rules`, which every backend of kq takes; this module runs each of them in JAX:

* ``exact``: the exact output from the arena: a miss's expert read inside the program by the host's
  ``fetch`` (:mod:`kq_jax.miss_fetch`), the router's weights as they are;
* ``tier``: the miss from its low-precision copy at its own weight (``route_shed(on_miss="tier")``);
* ``shed``: the miss dropped, the kept weights as they are (:data:`kq_core.rules.DEFAULT_RULE`);
* ``route_shed``: the miss dropped, the kept weights scaled to keep the row's routed mass
  (``route_shed``'s ``mix``);
* ``renormalize``: the miss dropped, the kept weights scaled to sum to 1;
* ``substitute``: the most probable resident expert the row did not choose, at the miss's weight;
* ``reroute``, ``prior``: cache-aware routing (the router's top-2k and resident experts; see
  :func:`serve`);
* ``uniform``: the ``tier`` step on a table that holds nothing, whatever the table given: every routed
  expert from the tier;
* ``stall``: every routed expert computed from the whole set of experts (the exact output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import kq_jax
from kq_core import rules
from kq_core.contract import RouteShedResult
from kq_core.rules import check_rule
from kq_core.validate import is_int
from kq_jax.miss_fetch import gather_with_misses
from kq_jax.moe import (Experts, TierExperts, apply_gathered, check_tier, combine, experts_apply, router_probs,
                        tiered_apply)
from kq_jax.reference import bounded_table, lookup_slots, normalize_topk_ref

RULES = rules.RULES  # every rule of kq_core.rules
TIER_RULES = rules.TIER_RULES  # a miss served from the tier
# Routed and shed by one topk_route_shed launch in moe_layer: every rule on an arena. stall, the layer with every
# expert, routes with the router's lax.top_k (router_topk), as the resident model does.
FUSED_RULES = tuple(rule for rule in RULES if rule != "stall")
RESIDENT_PRIOR = rules.RESIDENT_PRIOR  # the ``prior`` rule's bonus to a resident expert's log-probability (nats)


def router_topk(probs, *, top_k: int, normalize: bool):
    """The router's top-k of ``probs`` float32 ``[T, E]``: ``(indices int32 [T, k], scores float32 [T, k])``,
    ``lax.top_k``'s, the scores renormalised by :func:`kq_jax.reference.normalize_topk_ref` (the contract's
    correctly rounded arithmetic) where ``normalize`` (Qwen3-MoE's ``norm_topk_prob``), else as they are."""
    scores, indices = lax.top_k(probs, top_k)
    return indices, normalize_topk_ref(scores) if normalize else scores


def moe_layer(x, router_w, slot_table, *, rule: str, top_k: int, normalize: bool, weights: Experts,
              num_slots: int, tier: TierExperts | None = None, slot_rows=None, impl: str = "auto", fetch=None,
              layer=0):
    """One MoE layer on an arena from its router's weights: the router, then :func:`arena_moe` under ``rule``.

    The step :class:`kq_jax.nnx.ArenaMoE` runs, :func:`kq_jax.qwen3_moe_arena.make_step`'s layers run and
    :func:`kq_jax.arena_moe.moe_ffn_arena` and :func:`~kq_jax.arena_moe.moe_ffn_tiered` run (rules ``route_shed`` and
    ``tier``), so the module and the functional layers compute with the same operations in the same order.
    Rules :data:`FUSED_RULES` (every rule on an arena) route and shed in one ``topk_route_shed`` launch, whose
    top-k and weights are :func:`router_topk`'s (``kq_core.oracle``'s order and arithmetic) and which keeps
    sharded rows on their devices (:mod:`kq_jax.partition`; XLA's own ``top_k`` gathers them on the CPU);
    ``stall`` takes the router's ``lax.top_k`` (:func:`router_topk`), as the resident model does, and lets
    :func:`arena_moe` shed.

    Args:
        x: ``[T, D]`` the layer's MoE input.
        router_w: ``[D, E]`` the router's weights (the checkpoint's ``[E, D]`` transposed inside the caller's
            jitted step, so the router's product keeps the checkpoint's layout). ``x`` and ``router_w``
            float32, bfloat16 or float16 (:func:`kq_jax.moe.router_probs`).
        slot_table: int32 ``[E]``, expert -> arena slot (negative: not resident).
        rule: one of :data:`RULES` (:mod:`kq_core.rules`).
        weights, num_slots, tier, slot_rows, impl, fetch, layer: as for :func:`arena_moe`.
        top_k: experts a token routes to; normalize: whether the router renormalises its top-k.

    Returns:
        ``(out [T, D], report)`` as :func:`arena_moe`.

    Raises:
        ValueError: ``rule`` is no rule of :data:`RULES`, naming it and listing them; or as :func:`arena_moe`.
        TypeError: ``x`` or ``router_w`` of another dtype, naming it (:func:`kq_jax.moe.router_probs`).
    """
    out, report, _ = moe_layer_with_routing(x, router_w, slot_table, rule=rule, top_k=top_k, normalize=normalize,
                                            weights=weights, num_slots=num_slots, tier=tier, slot_rows=slot_rows,
                                            impl=impl, fetch=fetch, layer=layer)
    return out, report


def moe_layer_with_routing(x, router_w, slot_table, *, rule: str, top_k: int, normalize: bool, weights: Experts,
                           num_slots: int, tier: TierExperts | None = None, slot_rows=None, impl: str = "auto",
                           fetch=None, layer=0):
    """:func:`moe_layer`, with ``topk_route_shed``'s result beside its output (what
    :func:`kq_jax.arena_moe.moe_ffn_arena` and :func:`~kq_jax.arena_moe.moe_ffn_tiered` return).

    Args:
        x, router_w, slot_table, rule, top_k, normalize, weights, num_slots, tier, slot_rows, impl, fetch, layer:
            as for :func:`moe_layer`.

    Returns:
        ``(out [T, D], report, routing)``: :func:`moe_layer`'s output and report, and for rules
        :data:`FUSED_RULES` the :class:`~kq_core.contract.TopkRouteShedResult` of the router's one
        ``topk_route_shed`` launch (its routing and ``route_shed``'s outputs, each ``[T, k]``); None for
        ``stall``, which routes with ``lax.top_k``.

    Raises:
        ValueError, TypeError: as :func:`moe_layer`.
    """
    check_rule(rule, "moe_layer")
    if rule == "uniform":
        slot_table = _holding_nothing(slot_table)
    probs = router_probs(x, router_w)
    routing = None
    if rule in FUSED_RULES:
        routing = kq_jax.topk_route_shed(probs, slot_table, top_k=top_k, normalize=normalize,
                                         on_miss="tier" if rule in TIER_RULES else "shed", num_slots=num_slots,
                                         impl=impl)
        indices, scores, shed = routing.indices, routing.scores, routing.shed
    else:
        (indices, scores), shed = router_topk(probs, top_k=top_k, normalize=normalize), None
    out, report = arena_moe(x, indices, scores, slot_table, rule=rule, weights=weights, num_slots=num_slots,
                            tier=tier, probs=probs, slot_rows=slot_rows, normalize=normalize, shed=shed, impl=impl,
                            fetch=fetch, layer=layer)
    return out, report, routing


def _holding_nothing(slot_table):
    """The ``uniform`` rule's table: ``slot_table``'s shape, every expert not resident (int32 -1)."""
    return jnp.full(jnp.shape(slot_table), -1, jnp.int32)


def serve(rule: str, indices, scores, probs, slot_table, shed, *, normalize: bool = False,
          num_slots: int | None = None):
    """``(slots [T, k], mix [T, k])`` a layer on an arena gathers and weights with, under a shedding rule.

    Args:
        rule: ``route_shed``, ``shed``, ``renormalize``, ``substitute``, ``reroute`` or ``prior``.
        indices, scores: the router's top-k ``[T, k]`` (int32, float32); probs: float32 ``[T, E]``;
        slot_table: int32 ``[E]``; shed: ``route_shed(indices, scores, slot_table, num_slots=num_slots)``;
        normalize: whether the router renormalises its top-k; num_slots: the arena's S.
    """
    kept = resident_entries(indices, slot_table, num_slots)
    if rule == "route_shed":
        return shed.slots, shed.mix
    if rule == "shed":
        return shed.slots, jnp.where(kept, scores, 0.0)
    if rule == "renormalize":
        kept_mass = jnp.sum(jnp.where(kept, scores, 0.0), axis=-1, keepdims=True)
        return shed.slots, jnp.where(kept, scores / jnp.where(kept_mass > 0, kept_mass, 1.0), 0.0)
    if rule in ("reroute", "prior"):
        return _cache_aware(rule, indices, probs, bounded_table(slot_table, num_slots), normalize=normalize)
    if rule == "substitute":
        routed = kq_jax.topk_route_shed(probs, slot_table, top_k=indices.shape[-1], normalize=normalize,
                                        on_miss="substitute", num_slots=num_slots)
        return routed.shed.slots, routed.shed.mix
    check_rule(rule, "serve", allowed=[r for r in RULES if r not in (*TIER_RULES, "stall", "exact")])
    raise AssertionError(f"serve: rule {rule!r} has no branch")  # every rule check_rule allows has one above


def resident_entries(indices, slot_table, num_slots: int | None):
    """bool ``[T, k]``: the routed entries ``route_shed`` keeps, an expert id in ``[0, E)`` whose table entry is a
    slot below ``num_slots`` (an id outside that range is shed, never looked up: JAX's indexing would clamp
    or wrap it onto another expert)."""
    return lookup_slots(indices, bounded_table(slot_table, num_slots))[0] >= 0


def _cache_aware(rule: str, indices, probs, table, *, normalize: bool):
    """``(slots, mix)`` of ``reroute`` (keep the first k/2 choices, fill the rest with the most probable
    resident experts of the top 2k) and ``prior`` (top-k of log-probabilities plus
    :data:`RESIDENT_PRIOR` for resident experts); ``table`` bounded."""
    k = indices.shape[-1]
    resident = table >= 0  # [E]
    if rule == "prior":
        _, chosen = lax.top_k(jnp.log(probs) + jnp.where(resident, RESIDENT_PRIOR, 0.0), k)
    else:
        keep = k // 2
        _, window = lax.top_k(probs, min(2 * k, probs.shape[-1]))
        rest = window[:, keep:]
        fill = jnp.take_along_axis(rest, jnp.argsort(~resident[rest], axis=-1, stable=True), axis=-1)
        chosen = jnp.concatenate([window[:, :keep], fill[:, :k - keep]], axis=-1)
    weights = jnp.take_along_axis(probs, chosen, axis=-1)
    if normalize:  # on the scale of the router's own top-k
        weights = weights / jnp.sum(jnp.take_along_axis(probs, indices, axis=-1), axis=-1, keepdims=True)
    slots = table[chosen]
    return jnp.where(slots >= 0, slots, 0), jnp.where(slots >= 0, weights, 0.0)


def full_table_moe(x, indices, scores, slot_table, *, weights: Experts):
    """:func:`arena_moe` for a table that holds every expert (:func:`kq_core.contract.holds_every_expert`):
    no routed expert can miss, so each is gathered from its slot and weighted by its score, with no
    ``route_shed``, no tier and no fetch. Output and report are ``arena_moe``'s, bit for bit, under rules
    ``route_shed``, ``shed`` and ``tier`` (``tests/test_moe_jax.py``); its output is the resident layer's,
    which is what rule ``exact`` gives (``tests/test_decode_e2e.py``). Not ``renormalize``, which divides
    by the kept mass, nor the cache-aware rules, which route by residency.

    Args:
        x: ``[T, D]``; indices, scores: the router's top-k, int32 and float32 ``[T, k]``;
        slot_table: int32 ``[E]``, every entry a slot of ``weights`` (the caller's check: not checked here,
            a traced table's values are unknown); weights: the arena, :class:`~kq_jax.moe.Experts` ``[S, ...]``.

    Returns:
        ``(out [T, D], report)`` as :func:`arena_moe`: no misses (ids -1, scores +0.0), every entry served.
    """
    y = experts_apply(x, weights, jnp.asarray(slot_table)[indices])
    report = (indices, scores, jnp.full_like(indices, -1), jnp.zeros_like(scores), scores)
    return combine(y, scores), report


def arena_moe(x, indices, scores, slot_table, *, rule: str, weights: Experts, num_slots: int,
              tier: TierExperts | None = None, probs=None, slot_rows=None, normalize: bool = False,
              shed: RouteShedResult | None = None, impl: str = "auto", fetch=None, layer=0):
    """One MoE layer's experts for a token batch on an arena, under ``rule``.

    Args:
        x: ``[T, D]`` the layer's MoE input.
        indices, scores: the router's top-k, int32 and float32 ``[T, k]``.
        slot_table: int32 ``[E]``, expert -> arena slot (negative: not resident).
        rule: one of :data:`RULES` (:mod:`kq_core.rules`); ``uniform`` takes the table as holding nothing.
        weights: the experts the slots gather from, :class:`~kq_jax.moe.Experts` ``[N, ...]``: the arena
            (``N = num_slots``), or with ``slot_rows`` any stack the slots map into; for ``stall``, all E
            experts, gathered by expert id.
        num_slots: the arena's S.
        tier: every expert's low-precision copy (rules ``tier`` and ``uniform``).
        probs: float32 ``[T, E]``, the router's probabilities (``substitute``, ``reroute``, ``prior``).
        slot_rows: int32 ``[S]``, the row of ``weights`` each slot holds (None: slot s is row s).
        normalize: whether the router renormalises its top-k (``substitute``, ``reroute``, ``prior``).
        shed: ``route_shed``'s result for this routing and table when the caller has it (``topk_route_shed``
            routes and sheds in one launch; for ``uniform``, a table that holds nothing); None: computed here.
        impl: ``route_shed``'s implementation.
        fetch: rule ``exact``: the host's reader of missed experts (:data:`kq_jax.miss_fetch.Fetch`);
            layer: the layer index (int or int32 scalar) it is called with.

    Returns:
        ``(out [T, D], report)``: the combined output in ``weights``' dtype, and the report's fields
        ``(indices, scores, miss_ids, miss_scores, served)`` (:mod:`kq_core.reports`), each ``[T, k]``.

    Raises:
        ValueError: ``rule`` is no rule of :data:`RULES` (naming it and listing them), or an argument the rule
            needs is missing or of another shape, naming it.
    """
    check_rule(rule, "arena_moe")
    if rule == "uniform":
        slot_table = _holding_nothing(slot_table)
    _check_layer_arguments(x, indices, scores, slot_table, rule, weights, num_slots, probs, slot_rows)
    on_miss = "tier" if rule in TIER_RULES else "shed"
    if on_miss == "tier" and tier is None:
        raise ValueError(f"arena_moe: rule {rule!r} needs the tier's experts (tier=...)")
    if on_miss == "tier":
        check_tier(tier, weights, num_experts=jnp.shape(slot_table)[-1], where="arena_moe: tier")
    if (rule == "exact") != (fetch is not None):
        raise ValueError(f"arena_moe: fetch= is for rule 'exact' and needed there, got rule {rule!r} with "
                         f"fetch={fetch!r}")
    if rule == "exact":
        _check_fetch_layer(layer)
    if shed is None:
        shed = kq_jax.route_shed(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss, impl=impl)

    def rows(slots):
        return slots if slot_rows is None else slot_rows[slots]

    # An id outside [0, E) is no expert: shed under every rule, as route_shed sheds it (weight 0, not a miss).
    looked_up, valid = lookup_slots(indices, bounded_table(slot_table, num_slots))
    if rule == "stall":
        y, mix = experts_apply(x, weights, jnp.where(valid, indices, 0)), jnp.where(valid, scores, 0.0)
    elif rule == "exact":
        hit = looked_up >= 0  # resident_entries's
        # an invalid entry reads nothing: gathered from any row, weighted 0
        gathered = gather_with_misses(weights, rows(jnp.where(hit, shed.slots, 0)), hit | ~valid,
                                      jnp.where(valid, indices, 0), fetch, layer)
        y, mix = apply_gathered(x, gathered), jnp.where(valid, scores, 0.0)
    elif on_miss == "tier":
        hit = shed.slots < num_slots
        stacked = weights.gate.shape[0]  # tiered_apply reads entry r >= N as the tier's expert r - N
        entries = jnp.where(hit, rows(jnp.where(hit, shed.slots, 0)), stacked + shed.slots - num_slots)
        y, mix = tiered_apply(x, weights, tier, entries), shed.mix
    else:
        slots, mix = serve(rule, indices, scores, probs, slot_table, shed, normalize=normalize,
                           num_slots=num_slots)
        y = experts_apply(x, weights, rows(slots))
    served = jnp.where(valid, scores, 0.0) if rule in ("stall", "exact") else jnp.where(mix > 0, scores, 0.0)
    return combine(y, mix), (indices, scores, shed.miss_ids, shed.miss_scores, served)


def _check_fetch_layer(layer) -> None:
    """ValueError naming ``layer`` unless it is an int >= 0 or an integer scalar array (>= 0 where its value
    is known): the layer ``fetch`` is told it reads for."""
    integer = isinstance(layer, (int, np.integer, np.ndarray, jax.Array)) and not isinstance(layer, (bool, np.bool_))
    if not integer or jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"arena_moe: layer must be an int >= 0 or an integer scalar, got {layer!r}")
    try:
        negative = int(np.asarray(layer)) < 0
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: its value is the caller's
    if negative:
        raise ValueError(f"arena_moe: layer must be >= 0, got {layer!r}")


def _check_layer_arguments(x, indices, scores, slot_table, rule, weights, num_slots, probs, slot_rows) -> None:
    """:func:`arena_moe`'s shapes, each refused by name (static shapes: once, at trace time, under ``jax.jit``)."""
    x_shape, index_shape, score_shape = jnp.shape(x), jnp.shape(indices), jnp.shape(scores)
    if len(index_shape) != 2 or score_shape != index_shape:
        raise ValueError(f"arena_moe: indices and scores must be [T, k] of one shape, got {list(index_shape)} and "
                         f"{list(score_shape)}")
    hidden = jnp.shape(weights.gate)[-1]
    if len(x_shape) != 2 or x_shape != (index_shape[0], hidden):
        raise ValueError(f"arena_moe: x must be [T, D] = [{index_shape[0]}, {hidden}] (the routing's rows, the "
                         f"experts' width), got {list(x_shape)}")
    if len(jnp.shape(slot_table)) != 1:
        raise ValueError(f"arena_moe: slot_table must be [E], got {list(jnp.shape(slot_table))}")
    if rule in ("substitute", "reroute", "prior") and probs is None:
        raise ValueError(f"arena_moe: rule {rule!r} routes with the router's probabilities: give probs=[T, E]")
    if rule != "stall":  # stall gathers all E experts by id
        rows = jnp.shape(weights.gate)[0] if slot_rows is None else jnp.shape(slot_rows)[0]
        if not is_int(num_slots) or not 1 <= num_slots <= rows:
            held = "weights holds" if slot_rows is None else "slot_rows maps"
            raise ValueError(f"arena_moe: num_slots must be an int in [1, {rows}] (the {held} {rows} slots), got "
                             f"{num_slots!r}")


def moe_ffn_arena(x, router_w, arena: Experts, slot_table, *, top_k: int, impl: str = "auto"):
    """The MoE layer on an arena of S slots under rule ``route_shed`` (a miss shed, the kept weights rescaled to
    the row's routed mass), its router renormalising its top-k: :func:`kq_jax.arena_moe.moe_layer`'s step, bit
    for bit, with ``topk_route_shed``'s result beside the output.

    Args:
        x: ``[T, D]``; router_w: ``[D, E]``; each float32, bfloat16 or float16.
        arena: :class:`Experts` with ``N = S``;
        slot_table: int32 ``[E]`` (-1 = not resident); impl: ``topk_route_shed``'s.

    Returns:
        ``(y [T, D], TopkRouteShedResult)``: the output, and the routing and
        ``route_shed`` outputs the host reads after the step.

    Raises:
        TypeError: ``x`` or ``router_w`` of another dtype, naming it (:func:`router_probs`).
        ValueError: a shape the layer cannot take, naming it (:func:`kq_jax.arena_moe.arena_moe`).
    """

    # num_slots: a table entry past the arena is shed, never gathered (jnp.take would clamp it).
    y, _, routing = moe_layer_with_routing(x, router_w, slot_table, rule="route_shed", top_k=top_k, normalize=True,
                                           weights=arena, num_slots=arena.gate.shape[0], impl=impl)
    return y, routing


def moe_ffn_tiered(x, router_w, arena: Experts, tier: TierExperts, slot_table, *, top_k: int,
                   impl: str = "auto"):
    """The MoE layer on an arena of S slots whose misses the tier serves: rule ``tier``, its router
    renormalising its top-k, :func:`kq_jax.arena_moe.moe_layer`'s step bit for bit.

    Each routed entry keeps its router weight; a hit (slot < S) gathers the arena's expert, a miss
    (slot S + e) expert e of the tier (:func:`quantized_apply`, cast to the arena's dtype). With every
    routed expert resident the output is :func:`moe_ffn_resident`'s, bit for bit.

    Args:
        x: ``[T, D]``; router_w: ``[D, E]``; each float32, bfloat16 or float16.
        arena: :class:`Experts` with ``N = S``;
        tier: :class:`TierExperts` of all E experts; slot_table: int32 ``[E]`` (-1 = not resident);
        impl: ``topk_route_shed``'s.

    Returns:
        ``(y [T, D], TopkRouteShedResult)``, as :func:`moe_ffn_arena`.

    Raises:
        TypeError: ``x`` or ``router_w`` of another dtype, naming it (:func:`router_probs`).
        ValueError: the tier does not hold the router's E experts or does not fit the arena
            (:func:`check_tier`; at trace time under ``jax.jit``).
    """

    check_tier(tier, arena, num_experts=router_w.shape[-1], where="moe_ffn_tiered: tier")
    y, _, routing = moe_layer_with_routing(x, router_w, slot_table, rule="tier", top_k=top_k, normalize=True,
                                           weights=arena, num_slots=arena.gate.shape[0], tier=tier, impl=impl)
    return y, routing
