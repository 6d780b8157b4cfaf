"""``route_shed`` as one fused Pallas kernel (Triton lowering), and its wrapper.

Two kernels for ``route_shed``; :func:`block_config` picks one by shape:

* The row kernel, one thread per row like the Metal kernel: a program handles
  ``block_rows`` rows, and every value in the arithmetic is a ``[block_rows]``
  vector holding one entry of each row, so a row's K entries sit in one
  thread's registers and the sequential sums are plain adds. With
  ``tiled_io`` (K <= 16; the default above 4096 rows) rows move between
  memory and registers as coalesced ``[block_rows, KP]`` tiles; otherwise each
  entry is loaded and stored with its own strided 4-byte access, and for
  K > 16 the second pass over the entries is a loop.
* The entry-lanes kernel (``entry_lanes``; the default up to 8 rows and for
  K > 16): one lane per entry, each lane counting its own rank in one loop
  over the row, the row's sums carried in the same loop.

A third kernel serves ``topk_route_shed`` (:func:`topk_route_shed_pallas`):
one row per program takes the router's softmax row, picks its top-k in k
steps of two warp reductions over the row's order keys, renormalises, and
runs the row kernel's arithmetic on the picks (``_shed_rows``, shared), so a
MoE layer on an arena launches one kernel between its softmax and its gathers.

Misses go straight to their rank's position and padding to the positions past
the row's last miss, so every output element is written once. All four
outputs come out of the one launch; loads and stores are masked, so a ragged
last block never touches memory outside the arrays. (On an H200 at 2^20 x 8
rows the strided kernel takes 323 us, its warps waiting on a full load/store
queue; the tiled one with PTX rounding 78 us, 1.03x the bandwidth floor. At
4096 x 64 the row kernel takes 43 us, entry lanes 22 us. docs/benchmarks.md
has the history and the measurements.)

Exactness on the GPU: the two roundings the contract asks for, ``s * scale``
and ``total / kept``, are the IEEE instructions ``mul.rn.f32`` and
``div.rn.f32`` written out as inline PTX (``ptx_arith``, the default on a
CUDA GPU), so neither Triton's approximate ``div.full.f32`` nor multiply-add
contraction can occur. Elsewhere (the interpreter, or ``ptx_arith=False``)
they go through the integer mantissa arithmetic of :mod:`kq_jax.exact_f32`.
The remaining float ops are adds, compares and selects, each followed by the
contract's flush. ``tests/test_pallas_lowering.py`` lowers the kernel to
Triton IR for CUDA and checks that no other float multiply or divide is there;
``tests/test_exact_f32.py`` checks both roundings against NumPy on a GPU.

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

from kq.validate import check_route_shed_args, check_topk_route_shed_args
from kq_jax.exact_f32 import canonicalize_nan, div_flush_raw, flush, mul_flush_raw
from kq_jax.reference import (NOT_A_MISS_KEY, RouteShed, TopkRouteShed, route_shed_reference, score_from_order_key,
                              score_order_key, topk_normalized_ref, topk_route_shed_reference)

# Rows per program: one row per thread. The strided kernel wants at least ~2
# programs per SM on an H100/H200 (132 SMs) before a block grows past one warp.
_MIN_BLOCK_ROWS = 32
_MAX_BLOCK_ROWS = 256
_TARGET_PROGRAMS = 264
# The largest K the kernels unroll over a row's entries: the row kernel's
# second pass (a loop above it), tiled I/O (refused above it) and the topk
# kernel (XLA's top-k above it). Public for tests and tools.
MAX_UNROLLED_K = 16
# Up to this many rows the strided kernel is the default (see block_config),
# and up to _LANES_MAX_ROWS the entry-lanes kernel.
_STRIDED_MAX_ROWS = 4096
_LANES_MAX_ROWS = 8
# topk_route_shed's key for a lane that holds no value or was already picked.
_RETIRED_KEY = 2**31 - 1
# topk_route_shed's kernel: rows per program, and experts per warp (see topk_block_config).
_TOPK_BLOCK_ROWS = 1
_TOPK_EXPERTS_PER_WARP = 1024


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class KernelConfig(NamedTuple):
    """Launch parameters; ``None`` fields are chosen by :func:`block_config`."""

    block_rows: int | None = None  # rows per program, a power of two
    num_warps: int | None = None
    # Move a program's rows between memory and registers as [block_rows, KP]
    # tiles (coalesced) instead of one strided 4-byte access per entry.
    # K <= 16 only; the default there above 4096 rows.
    tiled_io: bool | None = None
    # Round ``s * scale`` and ``total / kept`` with PTX's IEEE ``mul.rn.f32`` /
    # ``div.rn.f32`` (inline assembly) instead of the integer mantissa
    # arithmetic of kq_jax.exact_f32. CUDA only; the default there.
    ptx_arith: bool | None = None
    # One lane per entry ([block_rows, KP] tiles), each lane counting its own
    # entry's rank in a loop over the row, instead of one thread per row.
    # The default at decode sizes (up to 8 rows) and for K > 16.
    entry_lanes: bool | None = None


def _on_cuda() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and "rocm" not in device.client.platform_version.lower()


def block_config(rows: int, k_width: int, config: KernelConfig | None = None, *,
                 interpret: bool = False) -> KernelConfig:
    """Resolves every field of ``config`` for a ``[rows, k_width]`` problem.

    Which kernel (row or entry lanes), how rows move (strided or tiled), how
    the two roundings are made, and the launch shape. Measured on an H200
    (kernel time, ``tools/gpu_tune.py``; docs/benchmarks.md):

    * Tiled I/O pays off once the grid is throughput-bound: 6.4 us against
      22.4 us at 65536 x 8 rows, 78 us against 322 us at 2^20 x 8. Up to 4096
      rows each SM holds at most one program, the per-thread chain of work is
      the time, and the strided kernel, with fewer instructions, is as fast or
      faster (2.2 against 3.1 us at one row), so it stays there.
    * At decode sizes (up to 8 rows) the entry-lanes kernel, its K entries
      spread over K lanes, is faster still: 1.7 against 2.2 us at 1 x 8, 2.2
      against 2.4 at 8 x 8 (3.5 against 3.3 at 4096 x 8). Past K = 16 it is
      the default at every size: 6.4 against 35 us at 1 x 64, where the row
      kernel's K^2 compares run in sequence on one thread, and 22 against
      43 us at 4096 x 64, in programs of 8 rows and 2 warps (32 rows: 42 us;
      4 rows: 25 us; 2 warps also at one row: 6.4 against 7.3 us with 1).
    * The tiled kernel's registers (~110 per thread at K = 8) cap an SM at
      16-18 resident warps whatever the block, so it runs one warp (32 rows)
      per program: the most programs to spread and the finest tail (78 us at
      2^20 rows, 129 us with 256-row programs). At K <= 4 it needs far fewer
      registers and 128-row programs of 4 warps win (1.6 against 2.5 us at
      65536 x 2).
    * The strided kernel keeps blocks small enough to give every SM work and
      grows them to 256 rows only when the grid is large anyway.

    ``config`` overrides any choice. The interpreter has no PTX, so
    ``interpret`` rules out ``ptx_arith``.
    """
    config = config or KernelConfig()
    entry_lanes = config.entry_lanes
    if entry_lanes is None:
        entry_lanes = (rows <= _LANES_MAX_ROWS or k_width > MAX_UNROLLED_K) and not config.tiled_io
    if entry_lanes and config.tiled_io:
        raise ValueError("route_shed_pallas: entry_lanes and tiled_io are two different kernels; pick one")
    tiled_io = config.tiled_io
    if tiled_io is None:
        tiled_io = k_width <= MAX_UNROLLED_K and rows > _STRIDED_MAX_ROWS and not entry_lanes
    if tiled_io and k_width > MAX_UNROLLED_K:
        raise ValueError(f"route_shed_pallas: tiled_io needs K <= {MAX_UNROLLED_K}, got K = {k_width}")
    ptx_arith = _resolve_ptx_arith("route_shed_pallas", config, interpret)
    if entry_lanes:
        wanted = 32 if k_width <= MAX_UNROLLED_K else 8
    elif tiled_io:
        wanted = 128 if k_width <= 4 else 32
    else:
        wanted = min(_MAX_BLOCK_ROWS, max(_MIN_BLOCK_ROWS, _next_power_of_two(-(-max(rows, 1) // _TARGET_PROGRAMS))))
    block_rows = _block_rows("route_shed_pallas", config.block_rows or wanted, rows)
    if entry_lanes:
        num_warps = 1 if k_width <= MAX_UNROLLED_K else 2
    else:
        num_warps = max(1, min(8, block_rows // 32))
    num_warps = config.num_warps or num_warps
    return KernelConfig(block_rows, num_warps, tiled_io, ptx_arith, entry_lanes)


def _resolve_ptx_arith(op: str, config: KernelConfig, interpret: bool) -> bool:
    """``config.ptx_arith``, by default on a CUDA GPU; refused by the interpreter, which has no PTX."""
    ptx_arith = (not interpret and _on_cuda()) if config.ptx_arith is None else config.ptx_arith
    if ptx_arith and interpret:
        raise ValueError(f"{op}: ptx_arith is inline PTX, which the interpreter cannot run")
    return ptx_arith


def _block_rows(op: str, block_rows: int, rows: int) -> int:
    """A power-of-two block, clamped to the rows there are."""
    if block_rows & (block_rows - 1):
        raise ValueError(f"{op}: block_rows must be a power of two, got {block_rows}")
    return min(block_rows, _next_power_of_two(max(rows, 1)))


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


def _classify(table_ref, ids, scores, live, *, num_experts: int, unsigned_ids: bool):
    """Entries' ``(id, s, slot, miss, key)`` from their ids and f32 scores (arrays of any one shape)."""
    scores = flush(scores)
    if unsigned_ids:
        valid = live & (ids < jnp.uint32(num_experts))
    else:
        valid = live & (ids >= 0) & (ids < num_experts)
    slots = plgpu.load(table_ref.at[jnp.where(valid, ids, 0).astype(jnp.int32)], mask=valid, other=-1)
    miss = valid & (slots < 0)
    # Misses order by descending score, NaN last, ties by lower k; non-misses
    # carry a key above every miss's, so they never push a miss back.
    key = jnp.where(miss, score_order_key(scores), NOT_A_MISS_KEY)
    return ids, scores, slots, miss, key


def _load_entries(ids_ref, scores_ref, at, mask):
    """The ids and f32 scores at flat positions ``at`` (any shape), masked."""
    return (plgpu.load(ids_ref.at[at], mask=mask, other=0),
            plgpu.load(scores_ref.at[at], mask=mask, other=0).astype(jnp.float32))


def _program_rows(block_rows: int, rows: int, k_width: int):
    """This program's rows as ``[block_rows]`` vectors: which exist, and where each starts in the flat arrays."""
    row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    return row < rows, row * k_width


def _roundings(ptx_arith: bool):
    """The contract's rounded ``(multiply, divide)``, both flushed."""
    return (ptx_mul_flush, ptx_div_flush) if ptx_arith else (mul_flush_raw, div_flush_raw)


def _scale(total, kept, divide):
    """``total / kept`` where the row kept some mass, else 0 (the contract's step 4)."""
    has_mass = kept > 0.0
    return jnp.where(has_mass, divide(total, jnp.where(has_mass, kept, 1.0)), 0.0)


def _store_misses(miss_ids_ref, miss_scores_ref, ids, scores, miss, rank_at, padding, padding_at):
    """Each miss at its rank's position; padding (-1, +0.0) where ``padding`` holds: each position once."""
    plgpu.store(miss_ids_ref.at[rank_at], ids.astype(jnp.int32), mask=miss)
    plgpu.store(miss_scores_ref.at[rank_at], canonicalize_nan(scores), mask=miss)
    plgpu.store(miss_ids_ref.at[padding_at], jnp.full(padding.shape, -1, jnp.int32), mask=padding)
    plgpu.store(miss_scores_ref.at[padding_at], jnp.zeros(padding.shape, jnp.float32), mask=padding)


def _route_shed_kernel(ids_ref, scores_ref, table_ref, slots_ref, mix_ref, miss_ids_ref, miss_scores_ref,
                       *, rows: int, k_width: int, num_experts: int, block_rows: int, unsigned_ids: bool,
                       tiled_io: bool, ptx_arith: bool):
    # Every value in the arithmetic is a [block_rows] vector holding one entry
    # k of each row: the K entries of a row sit in one thread's registers, as
    # in the Metal kernel's one-thread-per-row loop, so the sequential sums are
    # plain adds and nothing crosses lanes. Only the way entries reach those
    # registers and leave them depends on ``tiled_io``.
    live, base = _program_rows(block_rows, rows, k_width)
    tile = None
    if tiled_io:
        padded_k = _next_power_of_two(k_width)
        col = lax.broadcasted_iota(jnp.int32, (block_rows, padded_k), 1)
        in_tile = live[:, None] & (col < k_width)
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
        return _classify(table_ref, *read_entry(k), live, num_experts=num_experts, unsigned_ids=unsigned_ids)

    _shed_rows(load_entry, (slots_ref, mix_ref, miss_ids_ref, miss_scores_ref), live, base,
               k_width=k_width, ptx_arith=ptx_arith, tile=tile)


def _shed_rows(load_entry, out_refs, live, base, *, k_width: int, ptx_arith: bool, tile=None):
    """The row kernel's arithmetic and stores, from entry k's ``_classify`` tuple ``load_entry(k)``.

    ``live`` and ``base`` are the program's ``[block_rows]`` row vectors;
    ``tile`` is ``(col, tile_at, in_tile)`` for tiled stores, None for strided.
    """
    slots_ref, mix_ref, miss_ids_ref, miss_scores_ref = out_refs
    block_rows = live.shape[0]
    multiply, divide = _roundings(ptx_arith)
    entries = [load_entry(k) for k in range(k_width)]
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

    def entry_outputs(k, s_k, slot_k, key_k):
        """Entry k's slot and mix, and its rank among the row's misses."""
        keep_k = slot_k >= 0
        slot_out = jnp.where(keep_k, slot_k, fallback).astype(slots_ref.dtype)
        mix_out = canonicalize_nan(jnp.where(keep_k, multiply(s_k, scale), 0.0))
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
            slot_out, mix_out, rank = entry_outputs(k, s_k, slot_k, key_k)
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
        slot_out, mix_out, rank = entry_outputs(k, s_k, slot_k, key_k)
        plgpu.store(slots_ref.at[at], slot_out, mask=live)
        plgpu.store(mix_ref.at[at], mix_out, mask=live)
        # Padding fills the positions past the row's last miss.
        _store_misses(miss_ids_ref, miss_scores_ref, id_k, s_k, miss_k, base + rank, live & (miss_count <= k), at)

    if k_width <= MAX_UNROLLED_K:
        for k, entry in enumerate(entries):
            store_entry(k, *entry)
    else:
        # Unrolling K entries of K compares each makes a huge kernel, slow to
        # compile; loop instead, re-reading entry k (an L1 hit).
        def store_one(k, carry):
            store_entry(k, *load_entry(k))
            return carry

        lax.fori_loop(0, k_width, store_one, 0)


def _route_shed_lanes_kernel(ids_ref, scores_ref, table_ref, slots_ref, mix_ref, miss_ids_ref, miss_scores_ref,
                             *, rows: int, k_width: int, num_experts: int, block_rows: int, unsigned_ids: bool,
                             ptx_arith: bool):
    # One lane per entry: a [block_rows, KP] tile holds a program's rows, and
    # each lane counts its own entry's rank in one loop over the row's entries
    # (K compares per lane instead of K^2 in sequence per thread). The same loop
    # carries the row's sequential sums, first kept slot and miss count as
    # [block_rows] vectors, entry j re-read from memory (an L1 hit) in k order.
    live, base = _program_rows(block_rows, rows, k_width)
    lane = lax.broadcasted_iota(jnp.int32, (block_rows, _next_power_of_two(k_width)), 1)
    in_tile = live[:, None] & (lane < k_width)
    at = base[:, None] + lane
    multiply, divide = _roundings(ptx_arith)
    classify = functools.partial(_classify, table_ref, num_experts=num_experts, unsigned_ids=unsigned_ids)
    ids, scores, slots, miss, key = classify(*_load_entries(ids_ref, scores_ref, at, in_tile), in_tile)

    def step(j, carry):
        total, kept, fallback, found, miss_count, rank = carry
        _, s_j, slot_j, miss_j, key_j = classify(*_load_entries(ids_ref, scores_ref, base + j, live), live)
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
    total, kept, fallback, _, miss_count, rank = lax.fori_loop(0, k_width, step, start)
    scale = _scale(total, kept, divide)
    keep = slots >= 0
    plgpu.store(slots_ref.at[at], jnp.where(keep, slots, fallback[:, None]).astype(slots_ref.dtype), mask=in_tile)
    mix = multiply(scores, jnp.broadcast_to(scale[:, None], scores.shape))
    plgpu.store(mix_ref.at[at], canonicalize_nan(jnp.where(keep, mix, 0.0)), mask=in_tile)
    # Padding fills the positions past the row's last miss.
    _store_misses(miss_ids_ref, miss_scores_ref, ids, scores, miss, base[:, None] + rank,
                  in_tile & (lane >= miss_count[:, None]), at)


def _topk_route_shed_kernel(probs_ref, table_ref, indices_ref, scores_ref, slots_ref, mix_ref, miss_ids_ref,
                            miss_scores_ref, *, rows: int, num_experts: int, top_k: int, block_rows: int,
                            ptx_arith: bool):
    # A [block_rows, EP] tile holds the program's rows of probabilities as
    # order keys; each of the top_k steps takes the row's smallest key (the
    # best value), lowest lane first, and retires it. The picks then feed the
    # row kernel's arithmetic as its entries, already in registers.
    live, probs_base = _program_rows(block_rows, rows, num_experts)
    _, base = _program_rows(block_rows, rows, top_k)
    padded_e = _next_power_of_two(num_experts)
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
    _, divide = _roundings(ptx_arith)
    entries = []
    for j, (pick, raw) in enumerate(picks):
        score = divide(raw, total)
        plgpu.store(indices_ref.at[base + j], pick, mask=live)
        plgpu.store(scores_ref.at[base + j], canonicalize_nan(score), mask=live)
        entries.append(_classify(table_ref, pick, score, live, num_experts=num_experts, unsigned_ids=False))
    _shed_rows(entries.__getitem__, (slots_ref, mix_ref, miss_ids_ref, miss_scores_ref), live, base,
               k_width=top_k, ptx_arith=ptx_arith)


# Jitted so that a program calling the op many times (one call per MoE layer)
# traces and lowers the kernel once per distinct shape, not once per call.
@functools.partial(jax.jit, static_argnames=("interpret", "config"))
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
    block_rows, num_warps, tiled_io, ptx_arith, entry_lanes = block_config(rows, k_width, config,
                                                                          interpret=interpret)
    params = dict(rows=rows, k_width=k_width, num_experts=num_experts, block_rows=block_rows,
                  unsigned_ids=indices.dtype == jnp.uint32, ptx_arith=ptx_arith)
    if entry_lanes:
        kernel = functools.partial(_route_shed_lanes_kernel, **params)
    else:
        kernel = functools.partial(_route_shed_kernel, tiled_io=tiled_io, **params)
    outputs = _launch(kernel, shapes, (indices.reshape(-1), scores.reshape(-1), slot_table),
                      name=f"route_shed_k{k_width}", programs=pl.cdiv(rows, block_rows), num_warps=num_warps,
                      interpret=interpret)
    return RouteShed(*(o.reshape(out_shape) for o in outputs))


def _launch(kernel, out_shapes, args, *, name: str, programs: int, num_warps: int, interpret: bool):
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


def topk_block_config(rows: int, num_experts: int, config: KernelConfig | None = None, *,
                      interpret: bool = False) -> KernelConfig:
    """Launch parameters of ``topk_route_shed``'s kernel for ``[rows, num_experts]`` probabilities.

    One row per program, one warp: on an H200 (``tools/gpu_topk_tune.py``,
    docs/benchmarks.md) the fastest (block_rows, num_warps) tried at every
    shape of more than one row, E = 64 to 256, 8 to 65536 rows (8 x 8 x 256:
    3.9 us, 8 rows per program 25 us; 65536 x 8 x 256: 117 us, the other nine
    142-1065 us): each of the top_k steps is two reductions across the row,
    which stay inside the warp.
    Past 1024 experts a row gets a warp per 1024 (up to 4; not measured).

    Only ``block_rows``, ``num_warps`` and ``ptx_arith`` apply; the kernel has
    one layout. ``config`` overrides any choice.
    """
    config = config or KernelConfig()
    if config.tiled_io or config.entry_lanes:
        raise ValueError("topk_route_shed_pallas: tiled_io and entry_lanes are route_shed's kernels, not this one's")
    ptx_arith = _resolve_ptx_arith("topk_route_shed_pallas", config, interpret)
    block_rows = _block_rows("topk_route_shed_pallas", config.block_rows or _TOPK_BLOCK_ROWS, rows)
    row_warps = block_rows * _next_power_of_two(num_experts) // _TOPK_EXPERTS_PER_WARP
    num_warps = config.num_warps or max(1, min(4, row_warps))
    return KernelConfig(block_rows, num_warps, False, ptx_arith, False)


@functools.partial(jax.jit, static_argnames=("top_k", "interpret", "config"))
def _topk_forward(probs, slot_table, *, top_k: int, interpret: bool, config: KernelConfig | None) -> TopkRouteShed:
    num_experts = probs.shape[-1]
    rows = probs.size // num_experts
    out_shape = probs.shape[:-1] + (top_k,)
    dtypes = (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.float32)
    if rows == 0:
        outputs = [jnp.zeros(out_shape, d) for d in dtypes]
    else:
        block_rows, num_warps, _, ptx_arith, _ = topk_block_config(rows, num_experts, config, interpret=interpret)
        kernel = functools.partial(_topk_route_shed_kernel, rows=rows, num_experts=num_experts, top_k=top_k,
                                   block_rows=block_rows, ptx_arith=ptx_arith)
        outputs = _launch(kernel, [jax.ShapeDtypeStruct((rows * top_k,), d) for d in dtypes],
                          (probs.reshape(-1), slot_table), name=f"topk_route_shed_k{top_k}",
                          programs=pl.cdiv(rows, block_rows), num_warps=num_warps, interpret=interpret)
        outputs = [o.reshape(out_shape) for o in outputs]
    indices, scores, *shed = outputs
    return TopkRouteShed(indices, scores, RouteShed(*shed))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _topk_route_shed_diff(probs, slot_table, top_k, interpret, config):
    return _topk_forward(probs, slot_table, top_k=top_k, interpret=interpret, config=config)


def _topk_route_shed_fwd(probs, slot_table, top_k, interpret, config):
    outputs = _topk_forward(probs, slot_table, top_k=top_k, interpret=interpret, config=config)
    return outputs, (probs, slot_table)


def _topk_route_shed_bwd(top_k, interpret, config, residuals, cotangents):
    # As for route_shed: the reference's autodiff, bit for bit, and no kernel.
    del interpret, config
    probs, slot_table = residuals

    def differentiable(p):
        routed = topk_route_shed_reference(p, slot_table, top_k=top_k)
        return routed.scores, routed.shed.mix

    _, pullback = jax.vjp(differentiable, probs)
    (d_probs,) = pullback((cotangents.scores, cotangents.shed.mix))
    return d_probs, None


_topk_route_shed_diff.defvjp(_topk_route_shed_fwd, _topk_route_shed_bwd)


def topk_route_shed_pallas(probs, slot_table, *, top_k: int, interpret: bool = False,
                           config: KernelConfig | None = None) -> TopkRouteShed:
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

    Returns:
        ``TopkRouteShed(indices, scores, shed)``, each array ``[..., top_k]``;
        ``scores`` and ``shed.mix`` are differentiable with respect to ``probs``.
    """
    check_topk_route_shed_args(probs, slot_table, top_k)
    if top_k > MAX_UNROLLED_K:
        indices, scores = topk_normalized_ref(probs, top_k=top_k)
        shed = route_shed_pallas(indices, scores, slot_table, interpret=interpret, config=config)
        return TopkRouteShed(indices, scores, shed)
    return _topk_route_shed_diff(probs, slot_table, int(top_k), interpret, config)
