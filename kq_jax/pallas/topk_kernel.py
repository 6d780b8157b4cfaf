"""``topk_route_shed``'s kernel: the router's top-k, its renormalisation and ``route_shed`` in one launch.

One row per program (see :mod:`kq_jax.pallas.config`) takes the router's
softmax row, picks its top-k in k steps of two warp reductions over the row's
order keys, renormalises, and runs the row kernel's arithmetic
(:func:`~kq_jax.pallas.route_shed_kernel.shed_rows`) on the picks, so a MoE
layer on an arena launches one kernel between its softmax and its gathers.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from kq_jax.exact_f32 import canonicalize_nan, flush
from kq_jax.pallas.config import next_power_of_two
from kq_jax.pallas.route_shed_kernel import classify, program_rows, roundings, shed_rows
from kq_jax.reference import score_from_order_key, score_order_key

# A lane that holds no value or was already picked.
_RETIRED_KEY = 2**31 - 1


def topk_route_shed_kernel(probs_ref, table_ref, indices_ref, scores_ref, slots_ref, mix_ref, miss_ids_ref,
                            miss_scores_ref, *, rows: int, num_experts: int, top_k: int, block_rows: int,
                            ptx_arith: bool, num_slots: int | None):
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
               top_k=top_k, ptx_arith=ptx_arith)


