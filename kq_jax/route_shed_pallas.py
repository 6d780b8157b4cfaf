"""``route_shed`` as one fused Pallas kernel (Triton lowering), and its wrapper.

One program handles ``block_rows`` rows as a ``[block_rows, KP]`` tile
(``KP`` = K rounded up to a power of two, as Triton needs); all four outputs
come out of the one launch. Loads and stores are masked, so a ragged last
block and a K that is not a power of two never touch memory outside the
arrays.

Exactness on the GPU: the kernel contains no floating-point multiply or
divide at all. ``s * scale`` and ``total / kept`` go through the integer
mantissa arithmetic of :mod:`kq_jax.exact_f32`, so neither Triton's
approximate ``div.full.f32`` nor multiply-add contraction can occur; the
remaining float ops are adds, compares and selects, each followed by the
contract's flush. The column extraction for the sequential sums is a masked
row sum with exactly one non-zero term, which is exact. ``tools/gpu_check.py``
greps the generated PTX to keep it that way.

Why Triton and not Mosaic GPU: the kernel gathers ``slot_table[ids]`` at
data-dependent addresses. Pallas' Triton lowering turns an integer-array
index into a masked pointer gather; Mosaic GPU (the lowering JAX 0.11 moves
to) works on SMEM/TMA tiles and warpgroup-wide arrays, with no per-lane
gather from global memory. A Mosaic GPU port would stage the slot table in
SMEM (E int32s, 16 KiB at E = 4096) with one TMA copy per block, do the gather
there with a per-thread layout, and express the per-row loops with
``plgpu.kernel``'s thread semantics; until then the Triton lowering is
selected explicitly through ``plgpu.CompilerParams`` and its deprecation
warning is filtered at the call site.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kq.validate import check_route_shed_args
from kq_jax.exact_f32 import canonicalize_nan, div_flush_raw, flush, mul_flush_raw
from kq_jax.reference import RouteShed, route_shed_reference, score_order_key

# The [rows, KP, KP] comparison tile for the miss ranks is the kernel's
# largest live value; this bounds it per program.
_RANK_TILE_ELEMENTS = 16384
_MAX_BLOCK_ROWS = 256


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class KernelConfig(NamedTuple):
    """Launch parameters; ``None`` fields are chosen by :func:`block_config`."""

    block_rows: int | None = None  # rows per program, a power of two
    num_warps: int | None = None


def block_config(rows: int, k_width: int, config: KernelConfig | None = None) -> tuple[int, int, int]:
    """Picks ``(block_rows, padded_k, num_warps)`` for a ``[rows, k_width]`` problem.

    The default keeps the ``[block_rows, KP, KP]`` rank tile at 16K elements;
    ``config`` overrides either choice (``tools/gpu_tune.py`` sweeps them).
    """
    config = config or KernelConfig()
    padded_k = _next_power_of_two(k_width)
    block_rows = config.block_rows or max(1, min(_MAX_BLOCK_ROWS, _RANK_TILE_ELEMENTS // (padded_k * padded_k)))
    if block_rows & (block_rows - 1):
        raise ValueError(f"route_shed_pallas: block_rows must be a power of two, got {block_rows}")
    block_rows = min(block_rows, _next_power_of_two(max(rows, 1)))
    num_warps = config.num_warps or (4 if block_rows * padded_k >= 512 else 1)
    return block_rows, padded_k, num_warps


def _column(tile, col, k):
    """``tile[:, k]`` as a masked row sum (exactly one non-zero term: exact)."""
    zero = jnp.zeros((), tile.dtype)
    return jnp.sum(jnp.where(col == k, tile, zero), axis=1)


def _route_shed_kernel(ids_ref, scores_ref, table_ref, slots_ref, mix_ref, miss_ids_ref, miss_scores_ref,
                       *, rows: int, k_width: int, num_experts: int, block_rows: int, padded_k: int,
                       unsigned_ids: bool):
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, padded_k), 0)
    col = lax.broadcasted_iota(jnp.int32, (block_rows, padded_k), 1)
    in_bounds = (row < rows) & (col < k_width)
    offsets = row * k_width + col

    ids = plgpu.load(ids_ref.at[offsets], mask=in_bounds, other=0)
    s = flush(plgpu.load(scores_ref.at[offsets], mask=in_bounds, other=0).astype(jnp.float32))
    if unsigned_ids:
        valid = in_bounds & (ids < jnp.uint32(num_experts))
    else:
        valid = in_bounds & (ids >= 0) & (ids < num_experts)
    safe_ids = jnp.where(valid, ids, 0).astype(jnp.int32)
    slot = plgpu.load(table_ref.at[safe_ids], mask=valid, other=-1)
    keep = slot >= 0

    total = jnp.zeros((block_rows,), jnp.float32)
    kept = jnp.zeros((block_rows,), jnp.float32)
    kept_s = jnp.where(keep, s, 0.0)
    for k in range(k_width):
        total = flush(total + _column(s, col, k))
        kept = jnp.where(_column(keep.astype(jnp.int32), col, k) > 0, flush(kept + _column(kept_s, col, k)), kept)
    has_mass = kept > 0.0
    scale = jnp.where(has_mass, div_flush_raw(total, jnp.where(has_mass, kept, 1.0)), 0.0)
    mix = jnp.where(keep, mul_flush_raw(s, scale[:, None]), 0.0)

    first_kept = jnp.min(jnp.where(keep, col, padded_k), axis=1)
    fallback = jnp.max(jnp.where(keep & (col == first_kept[:, None]), slot, 0), axis=1)
    slots = jnp.where(keep, slot, fallback[:, None])

    # Rank of each miss among the row's misses: descending score, NaN last,
    # ties by lower k. The packed outputs are integer sums with one term.
    miss = valid & ~keep
    key = score_order_key(s)
    key_j, key_k = key[:, :, None], key[:, None, :]
    col_j, col_k = col[:, :, None], col[:, None, :]
    before = miss[:, :, None] & ((key_j < key_k) | ((key_j == key_k) & (col_j < col_k)))
    rank = jnp.where(miss, jnp.sum(before.astype(jnp.int32), axis=1), -1)
    miss_count = jnp.sum(miss.astype(jnp.int32), axis=1)
    lands = rank[:, None, :] == col[:, :, None]  # [rows, position, k]
    packed_ids = jnp.sum(jnp.where(lands, ids.astype(jnp.int32)[:, None, :], 0), axis=2)
    score_bits = lax.bitcast_convert_type(s, jnp.int32)
    packed_bits = jnp.sum(jnp.where(lands, score_bits[:, None, :], 0), axis=2)
    filled = col < miss_count[:, None]

    plgpu.store(slots_ref.at[offsets], slots.astype(slots_ref.dtype), mask=in_bounds)
    plgpu.store(mix_ref.at[offsets], canonicalize_nan(mix), mask=in_bounds)
    plgpu.store(miss_ids_ref.at[offsets], jnp.where(filled, packed_ids, -1), mask=in_bounds)
    packed_scores = lax.bitcast_convert_type(jnp.where(filled, packed_bits, 0), jnp.float32)
    plgpu.store(miss_scores_ref.at[offsets], canonicalize_nan(packed_scores), mask=in_bounds)


def _pallas_forward(indices, scores, slot_table, *, interpret: bool, config: KernelConfig | None) -> RouteShed:
    out_shape = indices.shape
    k_width = out_shape[-1]
    rows = indices.size // k_width
    num_experts = slot_table.shape[0]
    shapes = (
        jax.ShapeDtypeStruct((rows * k_width,), indices.dtype),
        jax.ShapeDtypeStruct((rows * k_width,), jnp.float32),
        jax.ShapeDtypeStruct((rows * k_width,), jnp.int32),
        jax.ShapeDtypeStruct((rows * k_width,), jnp.float32),
    )
    if rows == 0:
        return RouteShed(*(jnp.zeros(out_shape, s.dtype) for s in shapes))
    block_rows, padded_k, num_warps = block_config(rows, k_width, config)
    kernel = functools.partial(
        _route_shed_kernel, rows=rows, k_width=k_width, num_experts=num_experts, block_rows=block_rows,
        padded_k=padded_k, unsigned_ids=indices.dtype == jnp.uint32)
    call = pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=(pl.cdiv(rows, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"route_shed_k{k_width}",
    )
    with warnings.catch_warnings():
        # JAX 0.11 deprecates the Triton lowering in favour of Mosaic GPU; see
        # the module docstring for why this kernel still needs it.
        warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
        outputs = call(indices.reshape(-1), scores.reshape(-1), slot_table)
    return RouteShed(*(o.reshape(out_shape) for o in outputs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _route_shed_diff(indices, scores, slot_table, interpret, config):
    return _pallas_forward(indices, scores, slot_table, interpret=interpret, config=config)


def _route_shed_fwd(indices, scores, slot_table, interpret, config):
    outputs = _pallas_forward(indices, scores, slot_table, interpret=interpret, config=config)
    return outputs, (indices, scores, slot_table)


def _route_shed_bwd(interpret, config, residuals, cotangents):
    # The backward pass is autodiff of the pure-jnp reference, so the kernel's
    # gradient is the reference's gradient bit for bit; it launches no kernel.
    del interpret, config
    indices, scores, slot_table = residuals
    _, pullback = jax.vjp(lambda s: route_shed_reference(indices, s, slot_table).mix, scores)
    (d_scores,) = pullback(cotangents.mix)
    return None, d_scores, None


_route_shed_diff.defvjp(_route_shed_fwd, _route_shed_bwd)


def route_shed_pallas(indices, scores, slot_table, *, interpret: bool = False,
                      config: KernelConfig | None = None) -> RouteShed:
    """``route_shed`` in one fused Pallas kernel launch.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]``.
        slot_table: int32 ``[E]``; negative = not resident.
        interpret: run the kernel in Pallas' interpreter (any backend, slow).
        config: launch parameters overriding :func:`block_config`'s choice.

    Returns:
        ``RouteShed(slots, mix, miss_ids, miss_scores)`` shaped like ``indices``;
        ``mix`` is differentiable with respect to ``scores``.
    """
    check_route_shed_args(indices, scores, slot_table)
    return _route_shed_diff(indices, scores, slot_table, interpret, config)
