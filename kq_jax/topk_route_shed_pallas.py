"""``topk_route_shed`` in Pallas: the router's top-k, its renormalisation and ``route_shed`` in one launch.

One row per program (see :mod:`kq_jax.pallas_config`) takes the router's
softmax row, picks its top-k in k steps of two warp reductions over the row's
order keys, renormalises, and runs the row kernel's arithmetic
(:func:`~kq_jax.route_shed_pallas.shed_rows`) on the picks, so a MoE
layer on an arena launches one kernel between its softmax and its gathers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kq_core.contract import RouteShedResult, TopkRouteShedResult
from kq_jax.ieee_f32 import canonicalize_nan, flush
from kq_jax.pallas_config import MAX_UNROLLED_K, KernelConfig, next_power_of_two, topk_block_config
from kq_jax.partition import rowwise
from kq_jax.reference import score_from_order_key, score_order_key, topk_normalized_ref, topk_route_shed_ref
from kq_jax.route_shed_pallas import (classify, launch, on_row_bucket, pad_rows, program_rows,
                                      roundings, route_shed_pallas, rows_launched, shed_rows, tier_base)

# A lane that holds no value or was already picked.
_RETIRED_KEY = 2**31 - 1


def topk_route_shed_kernel(probs_ref, table_ref, indices_ref, scores_ref, slots_ref, mix_ref, miss_ids_ref,
                            miss_scores_ref, *, rows: int, num_experts: int, top_k: int, block_rows: int,
                            ptx_arith: bool, num_slots: int | None, on_miss: str):
    # A [block_rows, EP] tile holds the program's rows of probabilities as
    # order keys; each of the top_k steps takes the row's smallest key (the
    # best value), lowest lane first, and retires it. The picks then feed the
    # row kernel's arithmetic as its entries, already in registers.
    live, probs_base = program_rows(block_rows, rows, num_experts)
    _, base = program_rows(block_rows, rows, top_k)
    padded_e = next_power_of_two(num_experts)
    lane = lax.broadcasted_iota(jnp.int32, (block_rows, padded_e), 1)
    in_tile = live[:, None] & (lane < num_experts)
    probs = plgpu.load(probs_ref.at[probs_base[:, None] + lane], mask=in_tile, other=0).astype(jnp.float32)
    key = jnp.where(in_tile, score_order_key(probs), _RETIRED_KEY)
    picks = []
    for _ in range(top_k):
        best = jnp.min(key, axis=1)
        pick = jnp.min(jnp.where(key == best[:, None], lane, padded_e), axis=1)
        key = jnp.where(lane == pick[:, None], _RETIRED_KEY, key)
        picks.append((pick, flush(score_from_order_key(best))))
    total = jnp.zeros((block_rows,), jnp.float32)
    for _, raw in picks:
        total = flush(total + raw)
    _, divide = roundings(ptx_arith)
    entries = []
    for j, (pick, raw) in enumerate(picks):
        score = divide(raw, total)
        plgpu.store(indices_ref.at[base + j], pick, mask=live)
        plgpu.store(scores_ref.at[base + j], canonicalize_nan(score), mask=live)
        entries.append(classify(table_ref, pick, score, live, num_experts=num_experts, unsigned_ids=False,
                                num_slots=num_slots))
    shed_rows(entries.__getitem__, (slots_ref, mix_ref, miss_ids_ref, miss_scores_ref), live, base,
               top_k=top_k, ptx_arith=ptx_arith, tier_base=tier_base(num_slots, on_miss))


# The launch.

def _topk_forward(probs, slot_table, *, top_k: int, interpret: bool, config: KernelConfig | None,
                  num_slots: int | None, on_miss: str) -> TopkRouteShedResult:
    num_experts = probs.shape[-1]
    rows = probs.size // num_experts
    outputs = _topk_launch(pad_rows(probs.reshape(rows, num_experts), rows_launched(rows, config)), slot_table,
                           top_k=top_k, interpret=interpret, config=config, num_slots=num_slots, on_miss=on_miss)
    return jax.tree.map(lambda o: o[:rows].reshape(probs.shape[:-1] + (top_k,)), outputs)


@functools.partial(jax.jit, static_argnames=("top_k", "interpret", "config", "num_slots", "on_miss"))
def _topk_launch(probs, slot_table, *, top_k: int, interpret: bool, config: KernelConfig | None,
                 num_slots: int | None, on_miss: str) -> TopkRouteShedResult:
    rows, num_experts = probs.shape
    out_shape = (rows, top_k)
    dtypes = (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.float32)
    if rows == 0:
        outputs = [jnp.zeros(out_shape, d) for d in dtypes]
    else:
        block_rows, num_warps, _, ptx_arith, _, _ = topk_block_config(rows, num_experts, config, interpret=interpret)
        kernel = functools.partial(topk_route_shed_kernel, rows=rows, num_experts=num_experts, top_k=top_k,
                                   block_rows=block_rows, ptx_arith=ptx_arith, num_slots=num_slots, on_miss=on_miss)
        outputs = launch(kernel, [jax.ShapeDtypeStruct((rows * top_k,), d) for d in dtypes],
                          (probs.reshape(-1), slot_table), name=f"topk_route_shed_k{top_k}",
                          programs=pl.cdiv(rows, block_rows), num_warps=num_warps, interpret=interpret)
        outputs = [o.reshape(out_shape) for o in outputs]
    indices, scores, *shed = outputs
    return TopkRouteShedResult(indices, scores, RouteShedResult(*shed))


@functools.partial(rowwise, num_row_args=1)
def _topk_rows(probs, slot_table, top_k, interpret, config, num_slots, on_miss):
    return _topk_forward(probs, slot_table, top_k=top_k, interpret=interpret, config=config, num_slots=num_slots,
                         on_miss=on_miss)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _topk_route_shed_diff(probs, slot_table, top_k, interpret, config, num_slots, on_miss):
    return _topk_rows(probs, slot_table, top_k, interpret, config, num_slots, on_miss)


def _topk_route_shed_fwd(probs, slot_table, top_k, interpret, config, num_slots, on_miss):
    outputs = _topk_rows(probs, slot_table, top_k, interpret, config, num_slots, on_miss)
    return outputs, (probs, slot_table)


def _topk_route_shed_bwd(top_k, interpret, config, num_slots, on_miss, residuals, cotangents):
    # As for route_shed: the reference's autodiff, bit for bit, and no kernel.
    del interpret, config
    probs, slot_table = residuals

    def differentiable(p):
        routed = topk_route_shed_ref(p, slot_table, top_k=top_k, num_slots=num_slots, on_miss=on_miss)
        return routed.scores, routed.shed.mix

    _, pullback = jax.vjp(differentiable, probs)
    (d_probs,) = pullback((cotangents.scores, cotangents.shed.mix))
    return d_probs, None


_topk_route_shed_diff.defvjp(_topk_route_shed_fwd, _topk_route_shed_bwd)


def topk_route_shed_pallas(probs, slot_table, *, top_k: int, interpret: bool = False,
                           config: KernelConfig | None = None, num_slots: int | None = None,
                           on_miss: str = "shed") -> TopkRouteShedResult:
    """``topk_route_shed`` in one fused Pallas kernel launch (``top_k <= 16``).

    Past 16 the per-row selection would unroll too far; the top-k and its
    normalisation then run in XLA (:func:`~kq_jax.reference.topk_normalized_ref`) and the
    shedding in :func:`route_shed_pallas`: two launches, the same bits.

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities.
        slot_table: int32 ``[E]``; negative = not resident.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``.
        interpret: run the kernel in Pallas' interpreter (any backend, slow).
        config: ``block_rows`` / ``num_warps`` / ``ptx_arith`` overriding
            :func:`topk_block_config`'s choice.
        num_slots, on_miss: as for ``kq_jax.topk_route_shed`` (``"shed"`` or ``"tier"``).

    Returns:
        ``TopkRouteShedResult(indices, scores, shed)``, each array ``[..., top_k]``;
        ``scores`` and ``shed.mix`` are differentiable with respect to ``probs``.
    """
    if top_k > MAX_UNROLLED_K:
        indices, scores = topk_normalized_ref(probs, top_k=top_k)
        shed = route_shed_pallas(indices, scores, slot_table, interpret=interpret, config=config, num_slots=num_slots,
                                 on_miss=on_miss)
        return TopkRouteShedResult(indices, scores, shed)
    return on_row_bucket(
        lambda p: _topk_route_shed_diff(p, slot_table, int(top_k), interpret, config, num_slots, on_miss),
        (probs,), config)
