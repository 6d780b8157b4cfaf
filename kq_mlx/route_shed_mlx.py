"""``kq_mlx.route_shed``: a lazy MLX op with a Metal kernel, a CUDA twin and a pure-``mx`` path.

One dispatcher picks the implementation from the stream the op runs on:

* a GPU stream with Metal: ``route_shed.metal`` through ``mx.fast.metal_kernel``
  (math mode "safe"), built once per (index dtype, score dtype, K);
* a GPU stream on MLX's CUDA backend: ``route_shed.cu`` through ``mx.fast.cuda_kernel``;
* a CPU stream (and any device without a kernel): :func:`route_shed_ops`,
  ordinary ``mlx.core`` ops in the contract's order, compiled with ``mx.compile``;
  only ops MLX can compile shapeless, so a caller's ``mx.compile(...,
  shapeless=True)`` around the op serves every row count.

All three are bit-exact with ``shared/spec.json``; nothing is evaluated until
the caller evaluates the outputs.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from kq_core.contract import (CANONICAL_NAN_BITS, F32_MIN_NORMAL, NAN_ORDER_KEY, RouteShedResult,
                              TopkRouteShedResult)
from kq_core.validate import check_route_shed_args, check_topk_route_shed_args, dtype_name
from kq_mlx import sources

THREADS_PER_GROUP = 256
MX_DTYPES = {"int32": mx.int32, "uint32": mx.uint32, "float32": mx.float32, "bfloat16": mx.bfloat16,
             "float16": mx.float16, "int8": mx.int8, "uint8": mx.uint8}



def flush_subnormals(x):
    """``x`` float32 with every subnormal made 0 (the contract's flush of an intermediate)."""
    return mx.where(mx.abs(x) < F32_MIN_NORMAL, 0.0, x)


_CANONICAL_NAN = np.array(CANONICAL_NAN_BITS, np.uint32).view(np.float32)


def canonical_nan(x):
    """``x`` float32 with every NaN made the contract's canonical NaN bits."""
    return mx.where(mx.isnan(x), mx.array(_CANONICAL_NAN), x)


def _order_key(s):
    bits = s.view(mx.int32)
    monotone = mx.where(bits >= 0, bits, mx.bitwise_xor(bits, 0x7FFFFFFF))
    return mx.where(mx.isnan(s), NAN_ORDER_KEY, -monotone)


def _over_k(reduce, x, *, axis: int = -1, keepdims: bool = False):
    """``reduce`` over the K axis; at K = 1 the entry itself, reduced by a squeeze.

    MLX 0.32.4's shapeless compile crashes the process on a reduction over an axis of length one.
    """
    if x.shape[axis] != 1:
        return reduce(x, axis=axis, keepdims=keepdims)
    out = x if keepdims else mx.squeeze(x, axis)
    return out.astype(mx.int32) if reduce is mx.sum and x.dtype == mx.bool_ else out


def _route_shed_ops_impl(indices, scores, slot_table, tier_base: int | None = None):
    # Every op works along the last axis, on rows of any rank, and is one MLX can compile shapeless
    # (no reshape, slice, bit view or constant of the row count), so mx.compile(..., shapeless=True)
    # around the op serves every row count.
    top_k = indices.shape[-1]
    ids = indices  # [..., k]
    s = flush_subnormals(scores.astype(mx.float32))  # [..., k], no -0.0 after the flush
    num_experts = slot_table.shape[0]
    if ids.dtype == mx.uint32:
        valid = ids < mx.array(num_experts, mx.uint32)
    else:
        valid = (ids >= 0) & (ids < num_experts)
    # mx gathers wrap negative indices, so invalid ids read slot 0 and are masked.
    safe = mx.where(valid, ids, 0).astype(mx.int32)
    slot = mx.where(valid, slot_table[safe], -1)
    keep = slot >= 0

    # Columns as a masked sum over the row: exact (the other terms are +0.0 and the scores hold no
    # -0.0), where mx.take along the last axis fixes the row count in a shapeless compile. A shed
    # entry adds +0.0 to ``kept``, which leaves it as it is (it is never -0.0).
    position = mx.arange(top_k, dtype=mx.int32)
    kept_s = mx.where(keep, s, 0.0)
    total = kept = _over_k(mx.sum, mx.where(keep, mx.array(0.0, mx.float32), mx.array(0.0, mx.float32)))
    for k in range(top_k):
        at_k = position == k
        total = flush_subnormals(total + _over_k(mx.sum, mx.where(at_k, s, 0.0)))
        kept = flush_subnormals(kept + _over_k(mx.sum, mx.where(at_k, kept_s, 0.0)))
    has_mass = kept > 0.0
    scale = mx.where(has_mass, flush_subnormals(total / mx.where(has_mass, kept, 1.0)), 0.0)
    mix = mx.where(keep, flush_subnormals(s * mx.expand_dims(scale, -1)), 0.0)

    # Entries are moved along the row by masked sums over a one-hot [..., i, j] mask, never by a sort or
    # a gather along the row: exact for the same reason as the columns, and MLX-CUDA 0.32.4's argsort and
    # take_along_axis fail from 65,536 rows on (docs/benchmarks.md).
    first_kept = _over_k(mx.min, mx.where(keep, position, top_k - 1), keepdims=True)
    slot_first_kept = _over_k(mx.sum, mx.where(position == first_kept, slot, 0), keepdims=True)
    slots = mx.where(keep, slot, mx.where(_over_k(mx.any, keep, keepdims=True), slot_first_kept, 0))

    # Misses by rank: each entry's rank is the number of entries before it in the contract's order
    # (misses first, by descending score, NaN after every number, ties by position), compared in pairs
    # on the floats: no bit view, and no reliance on a stable sort.
    miss = valid & ~keep
    if tier_base is not None:  # on_miss="tier": a miss at slot S + id, every served entry at its score
        slots = mx.where(miss, tier_base + safe, slots)
        mix = mx.where(valid, s, 0.0)
    group = mx.where(miss, mx.where(mx.isnan(s), 1, 0), 2)  # 0: a miss with a number, 1: a NaN miss, 2: no miss
    g_i, g_j = mx.expand_dims(group, -1), mx.expand_dims(group, -2)
    s_i, s_j = mx.expand_dims(s, -1), mx.expand_dims(s, -2)
    earlier = mx.expand_dims(position, 1) < mx.expand_dims(position, 0)
    by_score = (g_i == 0) & (s_i != s_j)
    before = (g_i < g_j) | ((g_i == g_j) & mx.where(by_score, s_i > s_j, earlier))  # [..., i, j]: i before j
    rank = _over_k(mx.sum, before, axis=-2)  # [..., i]: a permutation of 0..K-1
    to_rank = mx.expand_dims(rank, -1) == position  # [..., i, j]: entry i is output j
    filled = position < _over_k(mx.sum, miss, keepdims=True)
    ranked_ids = _over_k(mx.sum, mx.where(to_rank, mx.expand_dims(ids.astype(mx.int32), -1), 0), axis=-2)
    ranked_scores = _over_k(mx.sum, mx.where(to_rank, s_i, 0.0), axis=-2)
    miss_ids = mx.where(filled, ranked_ids, -1)
    miss_scores = mx.where(filled, ranked_scores, 0.0)
    return slots.astype(indices.dtype), canonical_nan(mix), miss_ids, canonical_nan(miss_scores)


@functools.lru_cache(maxsize=None)
def _route_shed_ops_compiled(top_k: int, num_experts: int, tier_base: int | None):
    """The op compiled shapeless, once per (K, E, tier base): one compile serves every row count.

    A shapeless compile is traced again only when a dtype or a rank changes, so the trace, which holds
    K, E and the tier base, gets a compiled function (and a function object, the key of MLX's compile
    cache) of its own per variant.
    """
    def route_shed_rows(indices, scores, slot_table):
        return _route_shed_ops_impl(indices, scores, slot_table, tier_base)

    return mx.compile(route_shed_rows, shapeless=True)


def route_shed_ops(indices, scores, slot_table, *, num_slots: int | None = None, on_miss: str = "shed",
                   compiled: bool = True) -> RouteShedResult:
    """The pure ``mlx.core`` implementation (any device; the CPU path).

    Its memory grows as rows x K^2 (about 3 GB at 65,536 x 64; docs/benchmarks.md): call it in
    blocks of rows at prefill sizes with large K.

    Args:
        indices, scores, slot_table, num_slots, on_miss: as :func:`route_shed`.
        compiled: run through ``mx.compile`` (the default; measured faster on
            the CPU, see docs/benchmarks.md) or op by op.
    """
    check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
    return _ops(*_as_mx(indices, scores, slot_table), num_slots=num_slots, on_miss=on_miss, compiled=compiled)


def _bounded(slot_table, num_slots: int | None):
    return slot_table if num_slots is None else mx.where(slot_table >= int(num_slots), -1, slot_table)


def _ops(indices, scores, slot_table, *, num_slots: int | None = None, on_miss: str = "shed",
         compiled: bool = True) -> RouteShedResult:
    slot_table = _bounded(slot_table, num_slots)
    tier_base = sources.tier_base(num_slots, on_miss)
    if compiled:
        fn = _route_shed_ops_compiled(indices.shape[-1], slot_table.shape[0], tier_base)
    else:
        fn = functools.partial(_route_shed_ops_impl, tier_base=tier_base)
    return RouteShedResult(*fn(indices, scores, slot_table))


def _kernel_spec(filename: str, index_dtype: str, score_dtype: str, top_k: int, tier: bool) -> dict:
    """The arguments both mx.fast kernel factories take, for one variant."""
    source = sources.load(filename)
    return dict(name=sources.kernel_name(index_dtype, score_dtype, top_k, tier), input_names=list(sources.INPUT_NAMES),
                output_names=list(sources.OUTPUT_NAMES), source=source.body, header=source.header,
                ensure_row_contiguous=True)


@functools.lru_cache(maxsize=None)
def metal_kernel(index_dtype: str, score_dtype: str, top_k: int, tier: bool = False):
    """Builds (once per variant) the Metal kernel; raises where Metal is unavailable."""
    if not mx.metal.is_available():
        raise RuntimeError("route_shed: the Metal kernel needs MLX with a Metal GPU")
    return mx.fast.metal_kernel(**_kernel_spec("route_shed.metal", index_dtype, score_dtype, top_k, tier),
                                compile_options={"math_mode": "safe"})


def _cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


@functools.lru_cache(maxsize=None)
def cuda_kernel(index_dtype: str, score_dtype: str, top_k: int, tier: bool = False):
    """Builds (once per variant) the CUDA twin; raises on an MLX build without CUDA."""
    if not _cuda_available():
        raise RuntimeError("route_shed: the CUDA kernel needs MLX built with its CUDA backend")
    return mx.fast.cuda_kernel(**_kernel_spec("route_shed.cu", index_dtype, score_dtype, top_k, tier))


def from_numpy(array: np.ndarray) -> mx.array:
    """NumPy (including ml_dtypes.bfloat16) to MLX, bit for bit; any strides (MLX takes no negative ones:
    such an array is copied first)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if dtype_name(array) == "bfloat16":
        return mx.array(array.view(np.uint16)).view(mx.bfloat16)
    return mx.array(array)


def _as_mx(*arrays):
    """MLX arrays as they are, anything else (checked already) through :func:`from_numpy`."""
    return tuple(a if isinstance(a, mx.array) else from_numpy(np.asarray(a)) for a in arrays)


def _launch(kernel, indices, scores, slot_table, *, template, stream) -> RouteShedResult:
    top_k = indices.shape[-1]
    rows = indices.size // top_k
    out_shape = indices.shape
    index_dtype = dtype_name(indices)
    if rows == 0:
        return RouteShedResult(*(mx.zeros(out_shape, MX_DTYPES[d]) for d in sources.output_dtypes(index_dtype)))
    outputs = kernel(
        inputs=[indices.reshape(rows, top_k), scores.reshape(rows, top_k), slot_table],
        template=template,
        grid=(rows, 1, 1),
        threadgroup=(min(THREADS_PER_GROUP, rows), 1, 1),
        output_shapes=[(rows, top_k)] * 4,
        output_dtypes=[MX_DTYPES[d] for d in sources.output_dtypes(index_dtype)],
        stream=stream,
    )
    return RouteShedResult(*(o.reshape(out_shape) for o in outputs))


def implementation_for(stream=None) -> str:
    """``"metal"``, ``"cuda"`` or ``"ops"``: what :func:`route_shed` runs on ``stream``."""
    if stream is None:
        stream = mx.default_device()
    if isinstance(stream, mx.Stream):
        stream = stream.device
    device_type = stream.type if isinstance(stream, mx.Device) else stream
    if device_type == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if _cuda_available():
            return "cuda"
    return "ops"


def route_shed(indices, scores, slot_table, *, num_slots: int | None = None, on_miss: str = "shed",
               stream=None) -> RouteShedResult:
    """Remaps routed experts to arena slots and sheds the non-resident ones, or serves them from a tier (lazily).

    A drop-in for mlx_kquant's ``route_shed``: builds into the caller's graph
    and evaluates nothing.

    Args:
        indices: uint32 (mlx-lm routers) or int32 ``[..., K]`` top-k expert ids,
            ``1 <= K <= 64``. Each input may be an ``mx.array`` or a NumPy array.
        scores: float32, bfloat16 or float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``; ``slot_table[e] >= 0`` is the arena slot of
            resident expert ``e``, negative means not resident.
        num_slots: the arena's slot count S: a table entry outside ``[0, S)``
            then counts as not resident, so the gathers after the op never read
            past the arena. None: no bound.
        on_miss: ``"shed"``, or ``"tier"``: a miss keeps its score and gets
            slot ``num_slots + id``, its expert's place in a low-precision tier
            of every expert placed after the arena's slots (needs ``num_slots``).
        stream: MLX stream or device to run on (default: the default stream).

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)`` shaped like ``indices``;
        ``slots`` has the dtype of ``indices``.

    Raises:
        TypeError / ValueError: a wrong dtype or shape, naming the argument.
    """
    check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
    indices, scores, slot_table = _as_mx(indices, scores, slot_table)
    impl = implementation_for(stream)
    if impl == "ops":
        with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
            return _ops(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    variant = (dtype_name(indices), dtype_name(scores), indices.shape[-1])
    tier = on_miss == "tier"
    build = metal_kernel if impl == "metal" else cuda_kernel
    template = [(name, MX_DTYPES.get(value, value))
                for name, value in sources.template_args(*variant, sources.slot_bound(num_slots), tier)]
    return _launch(build(*variant, tier), indices, scores, slot_table, template=template, stream=stream)


def _topk_route_shed_ops_impl(probs, slot_table, *, top_k: int, normalize: bool, on_miss: str,
                              tier_base: int | None):
    """``probs``: ``[rows, E]``; the six outputs ``[rows, top_k]``."""
    num_experts = probs.shape[-1]
    values = probs.astype(mx.float32)
    expert = mx.arange(num_experts, dtype=mx.int64)
    # The contract's total order, made unique by the expert id so argsort's stability does not matter.
    order = mx.argsort(_order_key(values).astype(mx.int64) * num_experts + expert, axis=1).astype(mx.int32)
    indices = order[:, :top_k]
    scores = flush_subnormals(mx.take_along_axis(values, indices, axis=1))
    if normalize:
        total = mx.zeros(scores.shape[:1], mx.float32)
        for j in range(top_k):
            total = flush_subnormals(total + scores[:, j])
        scores = flush_subnormals(scores / total[:, None])
    scores = canonical_nan(scores)
    shed = _route_shed_ops_impl(indices, scores, slot_table, tier_base)
    if on_miss == "substitute":
        shed = _substitute_ops(order, indices, scores, slot_table, shed)
    return (indices, scores, *shed)


def _substitute_ops(order, indices, scores, slot_table, shed):
    """kq_core.oracle's step 4: the j-th miss in k order served by the j-th best resident expert not chosen."""
    rows, num_experts = order.shape
    top_k = indices.shape[-1]
    chosen = mx.any(indices[:, :, None] == mx.arange(num_experts)[None, None, :], axis=1)  # [rows, E]
    eligible = mx.take_along_axis((slot_table >= 0)[None, :] & ~chosen, order, axis=1)  # in order
    # Eligible positions first, in order: a unique key (ineligible pushed back by E).
    firsts = mx.argsort(mx.where(eligible, 0, num_experts) + mx.arange(num_experts)[None, :], axis=1)[:, :top_k]
    found_any = mx.take_along_axis(eligible, firsts, axis=1)
    candidates = mx.where(found_any, mx.take_along_axis(order, firsts, axis=1), -1)
    kept = slot_table[indices] >= 0
    rank = mx.clip(mx.cumsum((~kept).astype(mx.int32), axis=1) - 1, 0, top_k - 1)
    candidate = mx.take_along_axis(candidates, rank, axis=1)
    found = ~kept & (candidate >= 0)
    slots = mx.where(found, slot_table[mx.maximum(candidate, 0)].astype(shed[0].dtype), shed[0])
    mix = mx.where(kept | found, scores, 0.0)
    return (slots, mix, shed[2], shed[3])


def topk_route_shed(probs, slot_table, *, top_k: int, normalize: bool = True, on_miss: str = "shed",
                    num_slots: int | None = None, stream=None) -> TopkRouteShedResult:
    """Routes each row to its top-k experts, renormalises, and sheds (or substitutes) the non-resident ones.

    The pure-``mx`` path on every stream (the Metal and CUDA kernels implement ``route_shed`` alone);
    bit-exact with ``kq_core.oracle.topk_route_shed_oracle``.

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities (``mx.array`` or NumPy).
        slot_table: int32 ``[E]``; ``>= 0`` is the arena slot of a resident expert.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``.
        normalize: renormalise the top-k values to sum to 1 (``norm_topk_prob``); otherwise keep them.
        on_miss: ``"shed"``, ``"substitute"`` (each miss served by the best resident expert the
            row did not choose, at the miss's weight), or ``"tier"`` (as for :func:`route_shed`).
        num_slots: as for :func:`route_shed`.
        stream: MLX stream or device to run on.

    Returns:
        ``TopkRouteShedResult(indices int32, scores float32, shed)``, each ``[..., top_k]``; ``shed.slots``
        is int32.
    """
    check_topk_route_shed_args(probs, slot_table, top_k, normalize=normalize, on_miss=on_miss, num_slots=num_slots)
    probs, slot_table = _as_mx(probs, slot_table)
    slot_table = _bounded(slot_table, num_slots)
    with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
        num_experts = probs.shape[-1]
        rows = probs.reshape(-1, num_experts)
        step = rows_per_sort(stream)
        parts = [_topk_route_shed_ops_impl(rows[start:start + step], slot_table, top_k=int(top_k),
                                           normalize=bool(normalize), on_miss=on_miss,
                                           tier_base=sources.tier_base(num_slots, on_miss))
                 for start in range(0, max(rows.shape[0], 1), step)]
        out_shape = probs.shape[:-1] + (int(top_k),)
        indices, scores, *shed = (mx.concatenate(list(outputs)).reshape(out_shape) for outputs in zip(*parts))
    return TopkRouteShedResult(indices, scores, RouteShedResult(*shed))


def rows_per_sort(stream=None) -> int:
    """The most rows one ``mx.argsort`` / ``mx.take_along_axis`` takes on ``stream``.

    MLX-CUDA 0.32.4 fails both from 65,536 rows ("cudaGraphAddKernelNode ... invalid argument";
    docs/benchmarks.md); :func:`topk_route_shed` sorts in blocks of this many rows there.
    """
    return 65535 if implementation_for(stream) == "cuda" else 2 ** 31 - 1
