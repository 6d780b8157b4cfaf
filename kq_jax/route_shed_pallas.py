"""``route_shed`` in Pallas (Triton lowering): the two kernels, the row arithmetic they share, their launch.

* The row kernel (:func:`route_shed_kernel`), one thread per row like the
  Metal kernel: a program handles ``block_rows`` rows, and every value in the
  arithmetic is a ``[block_rows]`` vector holding one entry of each row, so a
  row's K entries sit in one thread's registers and the sequential sums are
  plain adds. With ``tiled_io`` rows move between memory and registers as
  coalesced ``[block_rows, KP]`` tiles; otherwise each entry is loaded and
  stored with its own strided 4-byte access, and for K > 16 the second pass
  over the entries is a loop.
* The entry-lanes kernel (:func:`route_shed_lanes_kernel`): one lane per
  entry, each lane counting its own rank in one loop over the row, the row's
  sums carried in the same loop.

:func:`shed_rows` is the row kernel's arithmetic and stores, which the
``topk_route_shed`` kernel (:mod:`kq_jax.topk_route_shed_pallas`) runs on its
picks. Misses go straight to their rank's position and padding to the
positions past the row's last miss, so every output element is written once;
loads and stores are masked, so a ragged last block never touches memory
outside the arrays.

Exactness on the GPU: the two roundings the contract asks for, ``s * scale``
and ``total / kept``, are the IEEE instructions ``mul.rn.f32`` and
``div.rn.f32`` written out as inline PTX (``ptx_arith``, the default on a
CUDA GPU), so neither Triton's approximate ``div.full.f32`` nor multiply-add
contraction can occur. Elsewhere (the interpreter, or ``ptx_arith=False``)
they go through the integer mantissa arithmetic of :mod:`kq_jax.ieee_f32`.
The remaining float ops are adds, compares and selects, each followed by the
contract's flush. ``tests/test_pallas_lowering.py`` lowers the kernels to
Triton IR for CUDA and checks that no other float multiply or divide is there.
Why Triton rather than Mosaic GPU: docs/kernels.md.

:func:`route_shed_pallas` launches them (the launch configuration is
:mod:`kq_jax.pallas_config`'s) and trusts its arguments: ``kq_jax.route_shed``
checks them first.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kq_core.contract import NOT_A_MISS_KEY, RouteShedResult
from kq_jax.ieee_f32 import canonicalize_nan, div_flush_raw, flush, mul_flush_raw
from kq_jax.pallas_config import MAX_UNROLLED_K, KernelConfig, block_config, next_power_of_two, row_bucket
from kq_jax.partition import rowwise
from kq_jax.reference import route_shed_ref, score_order_key


def _ptx_rn(opcode: str, a, b):
    """``flush(a <opcode> b)`` as one IEEE round-to-nearest PTX instruction.

    Written with ``.rn`` and without ``.ftz``, the instruction is the correctly
    rounded IEEE operation, subnormal results included, and PTX never fuses an
    instruction with an explicit rounding mode into an FMA; the flush after it
    is the contract's. Inside a Pallas Triton kernel on a CUDA GPU only.
    """
    [result] = plgpu.elementwise_inline_asm(
        f"{opcode}.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return flush(result)


ptx_mul_flush = functools.partial(_ptx_rn, "mul")
ptx_div_flush = functools.partial(_ptx_rn, "div")


def _column(tile, col, k):
    """``tile[:, k]`` of an integer tile, as a masked row sum (one non-zero term: exact)."""
    return jnp.sum(jnp.where(col == k, tile, jnp.zeros((), tile.dtype)), axis=1)


def classify(table_ref, ids, scores, live, *, num_experts: int, unsigned_ids: bool, num_slots: int | None):
    """Entries' ``(id, s, slot, miss, key)`` from their ids and f32 scores (arrays of any one shape)."""
    scores = flush(scores)
    if unsigned_ids:
        valid = live & (ids < jnp.uint32(num_experts))
    else:
        valid = live & (ids >= 0) & (ids < num_experts)
    slots = plgpu.load(table_ref.at[jnp.where(valid, ids, 0).astype(jnp.int32)], mask=valid, other=-1)
    if num_slots is not None:  # an entry the arena cannot hold is not resident
        slots = jnp.where(slots >= num_slots, -1, slots)
    miss = valid & (slots < 0)
    # Misses order by descending score, NaN last, ties by lower k; non-misses
    # carry a key above every miss's, so they never push a miss back.
    key = jnp.where(miss, score_order_key(scores), NOT_A_MISS_KEY)
    return ids, scores, slots, miss, key


def _load_entries(ids_ref, scores_ref, at, mask):
    """The ids and f32 scores at flat positions ``at`` (any shape), masked."""
    return (plgpu.load(ids_ref.at[at], mask=mask, other=0),
            plgpu.load(scores_ref.at[at], mask=mask, other=0).astype(jnp.float32))


def program_rows(block_rows: int, rows: int, top_k: int):
    """This program's rows as ``[block_rows]`` vectors: which exist, and where each starts in the flat arrays."""
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    return row < rows, row * top_k


def roundings(ptx_arith: bool):
    """The contract's rounded ``(multiply, divide)``, both flushed."""
    return (ptx_mul_flush, ptx_div_flush) if ptx_arith else (mul_flush_raw, div_flush_raw)


def _scale(total, kept, divide):
    """``total / kept`` where the row kept some mass, else 0 (the contract's step 4)."""
    has_mass = kept > 0.0
    return jnp.where(has_mass, divide(total, jnp.where(has_mass, kept, 1.0)), 0.0)


def served(id_k, s_k, slot_k, miss_k, fallback, scale, multiply, tier_base: int | None):
    """Entries' ``(slot, mix)``: kept at their slot with ``s * scale``, shed at ``fallback`` with +0.0.

    With ``tier_base`` (``on_miss="tier"``: the arena's slot count S) nothing is rescaled: a miss takes
    slot ``S + id`` and every served entry (kept or missed) its score.
    """
    keep_k = slot_k >= 0
    if tier_base is None:
        return jnp.where(keep_k, slot_k, fallback), canonicalize_nan(jnp.where(keep_k, multiply(s_k, scale), 0.0))
    slot = jnp.where(keep_k, slot_k, jnp.where(miss_k, tier_base + id_k.astype(jnp.int32), fallback))
    return slot, canonicalize_nan(jnp.where(keep_k | miss_k, s_k, 0.0))


def _store_misses(miss_ids_ref, miss_scores_ref, ids, scores, miss, rank_at, padding, padding_at):
    """Each miss at its rank's position; padding (-1, +0.0) where ``padding`` holds: each position once."""
    plgpu.store(miss_ids_ref.at[rank_at], ids.astype(jnp.int32), mask=miss)
    plgpu.store(miss_scores_ref.at[rank_at], canonicalize_nan(scores), mask=miss)
    plgpu.store(miss_ids_ref.at[padding_at], jnp.full(padding.shape, -1, jnp.int32), mask=padding)
    plgpu.store(miss_scores_ref.at[padding_at], jnp.zeros(padding.shape, jnp.float32), mask=padding)


def route_shed_kernel(ids_ref, scores_ref, table_ref, slots_ref, mix_ref, miss_ids_ref, miss_scores_ref,
                       *, rows: int, top_k: int, num_experts: int, block_rows: int, unsigned_ids: bool,
                       tiled_io: bool, ptx_arith: bool, num_slots: int | None, on_miss: str):
    # Every value in the arithmetic is a [block_rows] vector holding one entry
    # k of each row: the K entries of a row sit in one thread's registers, as
    # in the Metal kernel's one-thread-per-row loop, so the sequential sums are
    # plain adds and nothing crosses lanes. Only the way entries reach those
    # registers and leave them depends on ``tiled_io``.
    live, base = program_rows(block_rows, rows, top_k)
    tile = None
    if tiled_io:
        padded_k = next_power_of_two(top_k)
        col = lax.broadcasted_iota(jnp.int32, (block_rows, padded_k), 1)
        in_tile = live[:, None] & (col < top_k)
        tile_at = base[:, None] + col
        id_tile, score_tile = _load_entries(ids_ref, scores_ref, tile_at, in_tile)
        score_bits = lax.bitcast_convert_type(score_tile, jnp.int32)
        tile = col, tile_at, in_tile

        def read_entry(k):
            return _column(id_tile, col, k), lax.bitcast_convert_type(_column(score_bits, col, k), jnp.float32)
    else:
        def read_entry(k):
            return _load_entries(ids_ref, scores_ref, base + k, live)

    def load_entry(k):
        return classify(table_ref, *read_entry(k), live, num_experts=num_experts, unsigned_ids=unsigned_ids,
                        num_slots=num_slots)

    shed_rows(load_entry, (slots_ref, mix_ref, miss_ids_ref, miss_scores_ref), live, base,
               top_k=top_k, ptx_arith=ptx_arith, tile=tile, tier_base=tier_base(num_slots, on_miss))


def tier_base(num_slots: int | None, on_miss: str) -> int | None:
    """The first tier slot (S) with ``on_miss="tier"``, None when misses are shed."""
    return num_slots if on_miss == "tier" else None


def shed_rows(load_entry, out_refs, live, base, *, top_k: int, ptx_arith: bool, tile=None,
              tier_base: int | None = None):
    """The row kernel's arithmetic and stores, from entry k's ``classify`` tuple ``load_entry(k)``.

    ``live`` and ``base`` are the program's ``[block_rows]`` row vectors;
    ``tile`` is ``(col, tile_at, in_tile)`` for tiled stores, None for strided;
    ``tier_base`` as for :func:`served`.
    """
    slots_ref, mix_ref, miss_ids_ref, miss_scores_ref = out_refs
    block_rows = live.shape[0]
    multiply, divide = roundings(ptx_arith)
    entries = [load_entry(k) for k in range(top_k)]
    total = jnp.zeros((block_rows,), jnp.float32)
    kept = jnp.zeros((block_rows,), jnp.float32)
    for _, s_k, slot_k, _, _ in entries:
        total = flush(total + s_k)
        kept = jnp.where(slot_k >= 0, flush(kept + s_k), kept)
    scale = _scale(total, kept, divide)
    fallback = jnp.zeros((block_rows,), jnp.int32)
    for _, _, slot_k, _, _ in reversed(entries):
        fallback = jnp.where(slot_k >= 0, slot_k, fallback)
    keys = [key_k for *_, key_k in entries]
    miss_count = sum(miss_k.astype(jnp.int32) for *_, miss_k, _ in entries)

    def entry_outputs(k, id_k, s_k, slot_k, miss_k, key_k):
        """Entry k's slot and mix, and its rank among the row's misses."""
        slot_out, mix_out = served(id_k, s_k, slot_k, miss_k, fallback, scale, multiply, tier_base)
        slot_out = slot_out.astype(slots_ref.dtype)
        rank = jnp.zeros((block_rows,), jnp.int32)
        for j, key_j in enumerate(keys):
            rank = rank + ((key_j < key_k) | ((key_j == key_k) & (j < k))).astype(jnp.int32)
        return slot_out, mix_out, rank

    if tile is not None:
        # Each output tile starts as its padding; entry k fills column k, and
        # a miss fills the column of its rank, so the misses end up packed.
        col, tile_at, in_tile = tile
        slots_tile = jnp.zeros(col.shape, slots_ref.dtype)
        mix_tile = jnp.zeros(col.shape, jnp.float32)
        miss_ids_tile = jnp.full(col.shape, -1, jnp.int32)
        miss_scores_tile = jnp.zeros(col.shape, jnp.float32)
        for k, (id_k, s_k, slot_k, miss_k, key_k) in enumerate(entries):
            slot_out, mix_out, rank = entry_outputs(k, id_k, s_k, slot_k, miss_k, key_k)
            slots_tile = jnp.where(col == k, slot_out[:, None], slots_tile)
            mix_tile = jnp.where(col == k, mix_out[:, None], mix_tile)
            lands = (col == rank[:, None]) & miss_k[:, None]
            miss_ids_tile = jnp.where(lands, id_k.astype(jnp.int32)[:, None], miss_ids_tile)
            miss_scores_tile = jnp.where(lands, canonicalize_nan(s_k)[:, None], miss_scores_tile)
        for ref, out_tile in ((slots_ref, slots_tile), (mix_ref, mix_tile), (miss_ids_ref, miss_ids_tile),
                              (miss_scores_ref, miss_scores_tile)):
            plgpu.store(ref.at[tile_at], out_tile, mask=in_tile)
        return

    def store_entry(k, id_k, s_k, slot_k, miss_k, key_k):
        at = base + k
        slot_out, mix_out, rank = entry_outputs(k, id_k, s_k, slot_k, miss_k, key_k)
        plgpu.store(slots_ref.at[at], slot_out, mask=live)
        plgpu.store(mix_ref.at[at], mix_out, mask=live)
        # Padding fills the positions past the row's last miss.
        _store_misses(miss_ids_ref, miss_scores_ref, id_k, s_k, miss_k, base + rank, live & (miss_count <= k), at)

    if top_k <= MAX_UNROLLED_K:
        for k, entry in enumerate(entries):
            store_entry(k, *entry)
    else:
        # Unrolling K entries of K compares each makes a huge kernel, slow to
        # compile; loop instead, re-reading entry k (an L1 hit).
        def store_one(k, carry):
            store_entry(k, *load_entry(k))
            return carry

        lax.fori_loop(0, top_k, store_one, 0)


def route_shed_lanes_kernel(ids_ref, scores_ref, table_ref, slots_ref, mix_ref, miss_ids_ref, miss_scores_ref,
                             *, rows: int, top_k: int, num_experts: int, block_rows: int, unsigned_ids: bool,
                             ptx_arith: bool, num_slots: int | None, on_miss: str):
    # One lane per entry: a [block_rows, KP] tile holds a program's rows, and
    # each lane counts its own entry's rank in one loop over the row's entries
    # (K compares per lane instead of K^2 in sequence per thread). The same loop
    # carries the row's sequential sums, first kept slot and miss count as
    # [block_rows] vectors, entry j re-read from memory (an L1 hit) in k order.
    live, base = program_rows(block_rows, rows, top_k)
    lane = lax.broadcasted_iota(jnp.int32, (block_rows, next_power_of_two(top_k)), 1)
    in_tile = live[:, None] & (lane < top_k)
    at = base[:, None] + lane
    multiply, divide = roundings(ptx_arith)
    classify_entries = functools.partial(classify, table_ref, num_experts=num_experts, unsigned_ids=unsigned_ids,
                        num_slots=num_slots)
    ids, scores, slots, miss, key = classify_entries(*_load_entries(ids_ref, scores_ref, at, in_tile), in_tile)

    def step(j, carry):
        total, kept, fallback, found, miss_count, rank = carry
        _, s_j, slot_j, miss_j, key_j = classify_entries(*_load_entries(ids_ref, scores_ref, base + j, live), live)
        keep_j = slot_j >= 0
        total = flush(total + s_j)
        kept = jnp.where(keep_j, flush(kept + s_j), kept)
        fallback = jnp.where(keep_j & ~found, slot_j, fallback)
        before = (key_j[:, None] < key) | ((key_j[:, None] == key) & (j < lane))
        return (total, kept, fallback, found | keep_j, miss_count + miss_j.astype(jnp.int32),
                rank + before.astype(jnp.int32))

    vector_zeros = jnp.zeros((block_rows,), jnp.float32)
    start = (vector_zeros, vector_zeros, jnp.zeros((block_rows,), jnp.int32), jnp.zeros((block_rows,), jnp.bool_),
             jnp.zeros((block_rows,), jnp.int32), jnp.zeros(lane.shape, jnp.int32))
    total, kept, fallback, _, miss_count, rank = lax.fori_loop(0, top_k, step, start)
    scale = jnp.broadcast_to(_scale(total, kept, divide)[:, None], scores.shape)
    slot_out, mix = served(ids, scores, slots, miss, fallback[:, None], scale, multiply,
                           tier_base(num_slots, on_miss))
    plgpu.store(slots_ref.at[at], slot_out.astype(slots_ref.dtype), mask=in_tile)
    plgpu.store(mix_ref.at[at], mix, mask=in_tile)
    # Padding fills the positions past the row's last miss.
    _store_misses(miss_ids_ref, miss_scores_ref, ids, scores, miss, base[:, None] + rank,
                  in_tile & (lane >= miss_count[:, None]), at)


# The launch.

def rows_launched(rows: int, config: KernelConfig | None) -> int:
    """The rows a launch covers: :func:`row_bucket`'s, unless ``config`` asks for the exact count."""
    return rows if config is not None and config.row_buckets is False else row_bucket(rows)


def pad_rows(x, rows: int):
    """``x`` ``[n, X]`` with zero rows appended up to ``rows``."""
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def on_row_bucket(op, row_args, config: KernelConfig | None):
    """``op(*row_args)``; called eagerly, on the rows padded to their bucket (and the padding dropped after).

    An eager call then reuses the executable compiled for its bucket instead
    of compiling the kernel for its exact row count. Traced (under a jit),
    ``op`` runs as it is, and each device pads its own rows in ``_pallas_forward``.
    """
    if any(isinstance(a, jax.core.Tracer) for a in row_args):
        return op(*row_args)
    shape = row_args[0].shape
    rows = math.prod(shape[:-1])
    padded_rows = rows_launched(rows, config)
    outputs = op(*(pad_rows(jnp.reshape(a, (rows, a.shape[-1])), padded_rows) for a in row_args))
    return jax.tree.map(lambda o: o[:rows].reshape(shape[:-1] + o.shape[-1:]), outputs)


def _pallas_forward(indices, scores, slot_table, *, interpret: bool, config: KernelConfig | None,
                    num_slots: int | None, on_miss: str) -> RouteShedResult:
    top_k = indices.shape[-1]
    rows = indices.size // top_k
    padded_rows = rows_launched(rows, config)
    outputs = _route_shed_launch(pad_rows(indices.reshape(rows, top_k), padded_rows),
                                 pad_rows(scores.reshape(rows, top_k), padded_rows), slot_table,
                                 interpret=interpret, config=config, num_slots=num_slots, on_miss=on_miss)
    return RouteShedResult(*(o[:rows].reshape(indices.shape) for o in outputs))


# Jitted on the launch's [rows, K], so that every row count of one bucket, and
# a program calling the op once per MoE layer, trace and lower the kernel once.
@functools.partial(jax.jit, static_argnames=("interpret", "config", "num_slots", "on_miss"))
def _route_shed_launch(indices, scores, slot_table, *, interpret: bool, config: KernelConfig | None,
                       num_slots: int | None, on_miss: str) -> RouteShedResult:
    rows, top_k = indices.shape
    num_experts = slot_table.shape[0]
    shapes = (
        jax.ShapeDtypeStruct((rows * top_k,), indices.dtype),
        jax.ShapeDtypeStruct((rows * top_k,), jnp.float32),
        jax.ShapeDtypeStruct((rows * top_k,), jnp.int32),
        jax.ShapeDtypeStruct((rows * top_k,), jnp.float32),
    )
    if rows == 0:
        return RouteShedResult(*(jnp.zeros(indices.shape, s.dtype) for s in shapes))
    block_rows, num_warps, tiled_io, ptx_arith, entry_lanes, _ = block_config(rows, top_k, config,
                                                                             interpret=interpret)
    params = dict(rows=rows, top_k=top_k, num_experts=num_experts, block_rows=block_rows,
                  unsigned_ids=indices.dtype == jnp.uint32, ptx_arith=ptx_arith, num_slots=num_slots,
                  on_miss=on_miss)
    if entry_lanes:
        kernel = functools.partial(route_shed_lanes_kernel, **params)
    else:
        kernel = functools.partial(route_shed_kernel, tiled_io=tiled_io, **params)
    outputs = launch(kernel, shapes, (indices.reshape(-1), scores.reshape(-1), slot_table),
                      name=f"route_shed_k{top_k}", programs=pl.cdiv(rows, block_rows), num_warps=num_warps,
                      interpret=interpret)
    return RouteShedResult(*(o.reshape(indices.shape) for o in outputs))


def launch(kernel, out_shapes, args, *, name: str, programs: int, num_warps: int, interpret: bool):
    """One ``pallas_call`` of ``kernel`` over a 1-D grid of ``programs``, through the Triton lowering."""
    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=(programs,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )
    with warnings.catch_warnings():
        # JAX 0.11 deprecates the Triton lowering in favour of Mosaic GPU; see
        # the module docstring for why these kernels still need it.
        warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
        return call(*args)


@functools.partial(rowwise, num_row_args=2)
def _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots, on_miss):
    return _pallas_forward(indices, scores, slot_table, interpret=interpret, config=config, num_slots=num_slots,
                           on_miss=on_miss)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _route_shed_diff(indices, scores, slot_table, interpret, config, num_slots, on_miss):
    return _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots, on_miss)


def _route_shed_fwd(indices, scores, slot_table, interpret, config, num_slots, on_miss):
    outputs = _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots, on_miss)
    return outputs, (indices, scores, slot_table)


def _route_shed_bwd(interpret, config, num_slots, on_miss, residuals, cotangents):
    # The backward pass is autodiff of the pure-jnp reference, so the kernel's
    # gradient is the reference's gradient bit for bit; it launches no kernel.
    del interpret, config
    indices, scores, slot_table = residuals
    _, pullback = jax.vjp(lambda s: route_shed_ref(indices, s, slot_table, num_slots, on_miss).mix, scores)
    (d_scores,) = pullback(cotangents.mix)
    return None, d_scores, None


_route_shed_diff.defvjp(_route_shed_fwd, _route_shed_bwd)


def route_shed_pallas(indices, scores, slot_table, *, interpret: bool = False, config: KernelConfig | None = None,
                      num_slots: int | None = None, on_miss: str = "shed") -> RouteShedResult:
    """``route_shed`` in one fused Pallas kernel launch.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]``.
        slot_table: int32 ``[E]``; negative = not resident.
        interpret: run the kernel in Pallas' interpreter (any backend, slow).
        config: launch parameters overriding :func:`block_config`'s choice.
        num_slots, on_miss: as for ``kq_jax.route_shed``.

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)`` shaped like ``indices``;
        ``mix`` is differentiable with respect to ``scores``.
    """
    return on_row_bucket(lambda i, s: _route_shed_diff(i, s, slot_table, interpret, config, num_slots, on_miss),
                          (indices, scores), config)
