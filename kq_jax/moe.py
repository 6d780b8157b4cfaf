"""A jittable MoE feed-forward that runs on a bounded expert arena through ``route_shed``.

:func:`kq_jax.arena_moe.moe_layer` is the layer on an arena under any rule of :mod:`kq_core.rules`;
:func:`moe_ffn_arena` (rule ``route_shed``) and :func:`moe_ffn_tiered` (rule ``tier``: a hit computed
with the arena's weights, a miss with its tier copy straight from its packed words,
:func:`quantized_apply`, in one graph) are that layer under one rule each, the pieces here its parts.

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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kq_core.contract import EXPERT_PROJECTIONS, SCORE_DTYPES
from kq_core.validate import dtype_name, is_int
from kq_host.tier import BITS, GROUP_SIZES
from kq_jax.reference import normalize_topk_ref


class TierWeights(NamedTuple):
    """One projection of the tier on the device (:class:`kq_host.tier.QuantizedWeight`'s arrays).

    Attributes:
        packed: uint32 ``[E, out, in * bits / 32]``; scales, biases: ``[E, out, in / group_size]``.
    """

    packed: jax.Array
    scales: jax.Array
    biases: jax.Array


class TierExperts(NamedTuple):
    """The tier of one layer: every expert's gate, up and down, quantized (``bits``, ``group_size``).

    A pytree whose leaves are the projections' arrays and whose static data is ``(bits, group_size)``: under
    ``jax.jit`` a tier passed as an argument keeps its format as Python ints, as a closed-over one does.
    """

    gate: TierWeights
    up: TierWeights
    down: TierWeights
    bits: int
    group_size: int


jax.tree_util.register_pytree_node(TierExperts, lambda tier: (tier[:3], tier[3:]),
                                   lambda options, weights: TierExperts(*weights, *options))


def tier_experts(layer: dict, *, bits: int, group_size: int, names=EXPERT_PROJECTIONS):
    """:class:`TierExperts` from ``kq_host.tier.Tier.layer(l)``'s ``{projection: QuantizedWeight}``."""
    return TierExperts(*(TierWeights(*(jnp.asarray(a) for a in layer[name])) for name in names),
                       bits=bits, group_size=group_size)


def _check_options(bits, group_size, where: str) -> None:
    """Raises ValueError naming ``bits`` or ``group_size`` if the tier's format does not take it."""
    if not (is_int(bits) and bits in BITS):
        raise ValueError(f"{where}: bits must be one of {BITS}, got {bits!r}")
    if not (is_int(group_size) and group_size in GROUP_SIZES):
        raise ValueError(f"{where}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def _check_format(weights: TierWeights, *, bits, group_size, where: str, width: int | None = None) -> None:
    """Raises ValueError naming the argument if ``weights``' arrays are not one tier projection quantized
    with ``bits`` and ``group_size`` (rows ``width`` values wide where given). Shapes only: free under jit."""
    _check_options(bits, group_size, where)
    packed, scales, biases = weights
    if packed.dtype != jnp.dtype("uint32"):
        raise ValueError(f"{where}.packed must be uint32 words, got {packed.dtype}")
    if packed.ndim < 2 or scales.shape != biases.shape or scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"{where}: packed {list(packed.shape)}, scales {list(scales.shape)} and biases "
                         f"{list(biases.shape)} must agree on every axis but the last")
    words, groups = packed.shape[-1], scales.shape[-1]
    values = words * 32 // bits if words * 32 % bits == 0 else None
    if width is not None and values != width:
        raise ValueError(f"{where}.packed: rows of {words} uint32 words are not {width} values of bits={bits}; "
                         f"bits disagrees with the packed arrays")
    if values is None or groups * group_size != values:
        held = f"{values} values" if values is not None else "no whole number of values"
        raise ValueError(f"{where}: rows of {words} uint32 words hold {held} at bits={bits}, the scales {groups} "
                         f"groups of group_size={group_size}; bits or group_size disagrees with the arrays")


def check_tier(tier: TierExperts, arena: Experts, *, num_experts: int | None = None,
               where: str = "tier") -> None:
    """Checks that ``tier`` fits the layer: its format, each projection's shape against ``arena``'s, and
    (where given) that it holds all ``num_experts`` experts the router routes among.

    Shapes only, so under ``jax.jit`` the check runs once, at trace time.

    Args:
        tier: :class:`TierExperts`; arena: :class:`Experts` ``[N, out, in]`` per projection.
        num_experts: E of the router, or None.

    Raises:
        ValueError: naming the projection and ``bits``, ``group_size`` or the expert count that disagrees.
    """
    _check_options(tier.bits, tier.group_size, where)
    counts = {}
    for name in Experts._fields:
        out, width = getattr(arena, name).shape[1:]
        weights = getattr(tier, name)
        _check_format(weights, bits=tier.bits, group_size=tier.group_size, where=f"{where}.{name}", width=width)
        if weights.packed.ndim != 3 or weights.packed.shape[1] != out:
            raise ValueError(f"{where}.{name}.packed is {list(weights.packed.shape)}; the arena's {name} has "
                             f"{out} rows an expert, so it takes [E, {out}, words]")
        counts[name] = weights.packed.shape[0]
    if len(set(counts.values())) != 1:
        raise ValueError(f"{where}: its projections hold different expert counts {counts}")
    held = counts["gate"]
    if num_experts is not None and held != num_experts:
        raise ValueError(f"{where} holds {held} experts, the router routes among {num_experts}: every expert the "
                         f"router can pick needs its copy in the tier")


def _unpack(packed, *, bits: int):
    """The q of gathered tier words ``[..., out, words]``: float32 ``[..., out, in]``, read out of the words
    as the little-endian bit stream they were packed in."""
    words = packed.shape[-1]
    values = words * 32 // bits
    position = jnp.arange(values, dtype=jnp.uint32) * bits  # each value's first bit in the row's stream
    word, shift = position // 32, position % 32
    low = jnp.take(packed, word, axis=-1) >> shift
    # A value that straddles two words (3 bits) takes its high bits from the next one.
    spill = jnp.where(shift + bits > 32, jnp.take(packed, jnp.minimum(word + 1, words - 1), axis=-1)
                      << ((32 - shift) % 32), 0)
    return ((low | spill) & ((1 << bits) - 1)).astype(jnp.float32)


def dequantize_rows(weights: TierWeights, rows, *, bits: int, group_size: int, dtype):
    """The experts ``rows`` ``[...]`` of one tier projection, dequantized: ``[..., out, in]`` of ``dtype``.

    ``scale * q + bias`` in float32 per group, :func:`kq_host.tier.dequantize`'s bits.

    Raises:
        ValueError: ``bits`` or ``group_size`` disagrees with the arrays.
    """
    _check_format(weights, bits=bits, group_size=group_size, where="dequantize_rows: weights")
    q = _unpack(weights.packed[rows], bits=bits)
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)  # no -1: rows may be none
    scales = weights.scales[rows].astype(jnp.float32)[..., None]
    biases = weights.biases[rows].astype(jnp.float32)[..., None]
    # 16-bit scales widen to float32 exactly and scale * q is exact (at most 11 + 8 significant bits), so XLA
    # contracting it with the add into an FMA, as it does on the CPU, rounds exactly as the host reference.
    return (groups * scales + biases).reshape(q.shape).astype(dtype)


def quantized_apply(weights: TierWeights, rows, v, *, bits: int, group_size: int):
    """Each entry's tier expert on its input, the weights never dequantized: ``rows`` ``[T, k]``,
    ``v`` ``[T, k, in]`` -> float32 ``[T, k, out]``.

    Per group, ``scale * sum(q * v) + bias * sum(v)``: a reduction over the gathered words that XLA fuses
    with their unpacking, so a miss reads its packed bits and scales, not a float copy of the expert.
    One compiled program, fenced (``lax.optimization_barrier``) at the gathered entries and at the
    output, so it gives the same bits called eagerly or inside any jitted program (XLA's CPU backend
    otherwise contracts its multiplies and adds into FMAs or not depending on the fusion around it).

    Raises:
        ValueError: ``bits`` or ``group_size`` disagrees with the arrays.
    """
    _check_format(weights, bits=bits, group_size=group_size, where="quantized_apply: weights")
    return _quantized_apply(weights, rows, v, bits=bits, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _quantized_apply(weights: TierWeights, rows, v, *, bits: int, group_size: int):
    gathered = TierWeights(*(a[rows] for a in weights))  # [T, k, out, ...]
    gathered, v = lax.optimization_barrier((gathered, v))
    q = _unpack(gathered.packed, bits=bits)  # [T, k, out, in]
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)  # [T, k, out, G, g]
    v = v.astype(jnp.float32).reshape(*v.shape[:-1], 1, v.shape[-1] // group_size, group_size)  # [T, k, 1, G, g]
    partial = jnp.sum(groups * v, axis=-1)  # [T, k, out, G]
    scales, biases = gathered.scales.astype(jnp.float32), gathered.biases.astype(jnp.float32)
    return lax.optimization_barrier(jnp.sum(partial * scales + biases * jnp.sum(v, axis=-1), axis=-1))


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
    """Softmax over experts in float32. x ``[T, D]``, router_w ``[D, E]`` -> ``[T, E]``.

    Both are taken as JAX arrays, as ``jax.jit`` takes its arguments (NumPy ones too: the product is XLA's, and
    NumPy float64 is float32 unless JAX runs with x64), of a dtype ``route_shed`` takes for its scores:
    float32, bfloat16 or float16.

    Raises:
        TypeError: ``x`` or ``router_w`` is, as a JAX array, of no such dtype (an integer, or float64 under
            x64), naming it.
    """
    x, router_w = jnp.asarray(x), jnp.asarray(router_w)
    for name, value in (("x", x), ("router_w", router_w)):
        if dtype_name(value) not in SCORE_DTYPES:
            raise TypeError(f"router_probs: {name} must be an array of dtype {' or '.join(SCORE_DTYPES)}, got "
                            f"{dtype_name(value)}")
    return jax.nn.softmax((x @ router_w).astype(jnp.float32), axis=-1)


def route(x, router_w, *, top_k: int):
    """Softmax top-k routing, renormalised over the chosen k (Qwen3-MoE with norm_topk_prob).

    ``lax.top_k``, then ``topk_route_shed``'s renormalisation (a sequential
    sum, a correctly rounded division) instead of XLA's approximate GPU
    division, so the resident and the arena layer route alike on every
    backend: softmax probabilities hold no NaN and no -0.0, where alone the
    two top-k orders differ.

    Args:
        x: ``[T, D]`` hidden states; router_w: ``[D, E]``; each float32, bfloat16 or float16
            (:func:`router_probs`).

    Returns:
        ``(indices int32 [T, k], scores float32 [T, k])``.

    Raises:
        TypeError: ``x`` or ``router_w`` of another dtype, naming it (:func:`router_probs`).
    """
    raw, indices = lax.top_k(router_probs(x, router_w), top_k)
    return indices, normalize_topk_ref(raw)


def experts_apply(x, experts: Experts, rows):
    """Each token's k experts on it: x ``[T, D]``, rows ``[T, k]`` rows of ``experts`` -> ``[T, k, D]``.

    The gather and the SwiGLU are fenced (``lax.optimization_barrier`` on the inputs and on the output),
    so the compiler fuses them the same way in every program, whatever produced the weights and whatever
    consumes the result: on a GPU, XLA's reductions otherwise take their order from the fusion around
    them, and the resident, the arena and the exact layers would differ in bits.
    """
    x, rows = lax.optimization_barrier((x, rows))
    gathered = Experts(*(jnp.asarray(w)[rows] for w in experts))
    gate = jnp.einsum("td,tkfd->tkf", x, gathered.gate)
    up = jnp.einsum("td,tkfd->tkf", x, gathered.up)
    return lax.optimization_barrier(jnp.einsum("tkf,tkdf->tkd", jax.nn.silu(gate) * up, gathered.down))


def apply_gathered(x, gathered: Experts):
    """:func:`experts_apply` on weights already gathered: x ``[T, D]``, weights ``[T, k, out, in]`` ->
    ``[T, k, D]``; the same program (a gather of each entry's own row), so the same bits."""
    tokens, k = gathered.gate.shape[:2]
    flat = Experts(*(g.reshape(tokens * k, *g.shape[2:]) for g in gathered))
    return experts_apply(x, flat, jnp.arange(tokens * k, dtype=jnp.int32).reshape(tokens, k))


def combine(y, mix):
    """The layer's output: each token's k expert outputs weighted by ``mix``. ``y`` ``[T, k, D]``, ``mix``
    ``[T, k]`` -> ``[T, D]`` of ``y``'s dtype. Fenced as :func:`experts_apply` is: the weighted sum's
    order does not depend on how ``mix`` was computed."""
    y, mix = lax.optimization_barrier((y, mix.astype(y.dtype)))
    return lax.optimization_barrier(jnp.einsum("tkd,tk->td", y, mix))


def moe_ffn_resident(x, router_w, experts: Experts, *, top_k: int):
    """The MoE layer with all E experts in memory. x ``[T, D]`` -> ``[T, D]``; x and router_w ``[D, E]``
    float32, bfloat16 or float16.

    Raises:
        TypeError: ``x`` or ``router_w`` of another dtype, naming it (:func:`router_probs`).
    """
    indices, scores = route(x, router_w, top_k=top_k)
    return combine(experts_apply(x, experts, indices), scores)


def tiered_apply(x, arena: Experts, tier: TierExperts, slots):
    """Each token's k experts on it, from the arena or the tier: ``slots`` ``[T, k]`` as ``route_shed``'s
    with ``on_miss="tier"`` (``< S``: an arena slot; ``S + e``: expert e of the tier) -> ``[T, k, D]``.

    Raises:
        ValueError: the tier does not fit the arena's experts (:func:`check_tier`).
    """
    check_tier(tier, arena, where="tiered_apply: tier")
    num_slots = arena.gate.shape[0]
    from_tier = slots >= num_slots  # [T, k]
    arena_rows, tier_rows = jnp.where(from_tier, 0, slots), jnp.where(from_tier, slots - num_slots, 0)
    # The hits' outputs come from experts_apply on the arena, the graph moe_ffn_arena and the resident
    # layer run, so that with no miss the bits are theirs on every backend (an einsum over a select of
    # the two weight sets fuses differently on a GPU); the misses' from the dequantized tier rows.
    hits = experts_apply(x, arena, arena_rows)
    options = dict(bits=tier.bits, group_size=tier.group_size)
    entries = jnp.broadcast_to(x[:, None, :], (*slots.shape, x.shape[-1]))  # [T, k, D]
    gate = quantized_apply(tier.gate, tier_rows, entries, **options)
    up = quantized_apply(tier.up, tier_rows, entries, **options)
    low = quantized_apply(tier.down, tier_rows, jax.nn.silu(gate) * up, **options).astype(hits.dtype)
    return jnp.where(from_tier[..., None], low, hits)
