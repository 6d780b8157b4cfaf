"""Misses read inside the jitted program: the exact rule with no host round trip between layers.

A layer whose routed experts are all in the arena gathers them from the arena alone. A layer with
misses calls the host once, from inside the program (``jax.experimental.io_callback``), with the
missed experts' ids; the host reads them (:class:`kq_host.miss_reader.MissReader`) and the program
puts them where the arena's rows would have been, so every entry is computed from its own expert's
weights: the layer's output is the resident model's, bit for bit, in one pass over the layers.

The callback's result has a static shape: the misses are counted in the program and the smallest of
:func:`miss_buckets` that holds them is the one called (``lax.switch``), so a layer reads and copies at
most about twice its misses' bytes, and a layer with none calls nothing.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

from kq_jax.moe import Experts

# fetch(layer, ids) -> each projection's weights of the experts ``ids`` (int32 [m], m >= 1), in
# :class:`~kq_jax.moe.Experts` order, each ``[m, out, in]`` of the arena's dtype.
Fetch = Callable[[int, np.ndarray], Sequence[np.ndarray]]


def miss_buckets(entries: int) -> tuple[int, ...]:
    """The callback sizes a layer of ``entries`` routed entries (``T * k``) may call: 1, 2, 4, ... up to
    ``entries``."""
    if entries < 1:
        raise ValueError(f"miss_buckets: entries must be >= 1, got {entries}")
    sizes, size = [], 1
    while size < entries:
        sizes.append(size)
        size *= 2
    return (*sizes, entries)


def _host_fetch(fetch: Fetch, shapes: tuple[jax.ShapeDtypeStruct, ...], layer, ids) -> tuple[np.ndarray, ...]:
    """The callback: ``fetch`` on the real ids (``ids >= 0``), checked, padded to the bucket's rows."""
    ids = np.asarray(ids)
    wanted = ids[ids >= 0]
    read = tuple(fetch(int(layer), wanted))
    if len(read) != len(shapes):
        raise ValueError(f"gather_with_misses: fetch returned {len(read)} arrays for layer {int(layer)}, expected "
                         f"{len(shapes)} (one per projection, in Experts order)")
    out = []
    for name, array, shape in zip(Experts._fields, read, shapes):
        array = np.asarray(array)
        if array.shape != (len(wanted), *shape.shape[1:]) or array.dtype != shape.dtype:
            raise ValueError(f"gather_with_misses: fetch's {name} for layer {int(layer)} (experts {wanted.tolist()}) "
                             f"is {array.dtype} {array.shape}, expected {np.dtype(shape.dtype)} "
                             f"{(len(wanted), *shape.shape[1:])}")
        padded = np.zeros(shape.shape, shape.dtype)
        padded[:len(wanted)] = array
        out.append(padded)
    return tuple(out)


def gather_with_misses(weights: Experts, rows, hit, indices, fetch: Fetch, layer) -> Experts:
    """Each routed entry's expert weights: a hit's from the arena, a miss's read by ``fetch``.

    Under ``jax.vmap`` the batch's entries are one layer's entries: ``fetch`` is called once for the whole
    batch. Differentiable in reverse mode: w.r.t. ``weights``, each hit's row gets its entries' cotangent
    (a miss's weights are the host's read, a constant).

    Args:
        weights: the arena, :class:`~kq_jax.moe.Experts` ``[N, ...]``.
        rows: int32 ``[T, k]``, the row of ``weights`` each hit's expert is in (any valid row for a miss).
        hit: bool ``[T, k]``, whether the entry's expert is resident.
        indices: int32 ``[T, k]``, the routed expert ids (a miss's an expert of ``[0, E)``).
        fetch: the host's reader, called inside the program when the layer misses: ``fetch(layer, ids)``
            with the missed experts' ids (int32 ``[m]``, in top-k order, repeats kept), returning each
            projection's ``[m, out, in]`` in ``weights``' dtypes.
        layer: int or int32 scalar, passed to ``fetch``.

    Returns:
        :class:`~kq_jax.moe.Experts` ``[T, k, ...]``.

    Raises:
        ValueError: under ``jax.vmap`` with ``layer`` batched (one layer per call).
    """
    gathered = Experts(*(jnp.asarray(w)[rows] for w in weights))
    return _fill_misses(fetch)(gathered, hit, indices, jnp.asarray(layer, jnp.int32))


def _fill_misses(fetch: Fetch):
    """``fill(gathered, hit, indices, layer)``: ``gathered`` (Experts ``[T, k, ...]``) with its misses'
    entries read by ``fetch``. Under ``jax.vmap`` the batch's routing is one layer's; its gradient w.r.t.
    ``gathered`` is the cotangent at the hits (a miss's entry is the host's read, not ``gathered``'s)."""
    fill = custom_vmap(partial(_fill_misses_once, fetch=fetch))

    @fill.def_vmap
    def fill_batch(axis_size, in_batched, gathered, hit, indices, layer):
        gathered_batched, *routing_batched, layer_batched = in_batched
        if layer_batched:
            raise ValueError("gather_with_misses: under jax.vmap, layer must be the same for the whole batch")
        routing = [r if batched else jnp.broadcast_to(r, (axis_size, *r.shape))
                   for r, batched in zip((hit, indices), routing_batched)]
        tokens, k = routing[0].shape[1:]
        gathered = Experts(*(g if batched else jnp.broadcast_to(g, (axis_size, *g.shape))
                             for g, batched in zip(gathered, gathered_batched)))
        filled = fill(Experts(*(g.reshape(axis_size * tokens, *g.shape[2:]) for g in gathered)),
                      *(r.reshape(axis_size * tokens, k) for r in routing), layer)
        return (Experts(*(f.reshape(axis_size, tokens, *f.shape[1:]) for f in filled)),
                Experts(*(True,) * len(filled)))

    def fill_forward(gathered, hit, indices, layer):
        return fill(gathered, hit, indices, layer), hit

    def fill_backward(hit, cotangent):
        at_hits = Experts(*(jnp.where(hit.reshape(*hit.shape, *(1,) * (c.ndim - hit.ndim)), c, 0)
                            for c in cotangent))
        return at_hits, None, None, None

    differentiable = jax.custom_vjp(fill)
    differentiable.defvjp(fill_forward, fill_backward)
    return differentiable


def _fill_misses_once(gathered: Experts, hit, indices, layer, *, fetch: Fetch) -> Experts:
    """:func:`_fill_misses` for one batch of routing."""
    tokens, k = indices.shape
    entries = tokens * k
    if entries == 0:  # no rows: nothing can miss
        return gathered
    flat_hit = hit.reshape(entries)
    order = jnp.argsort(flat_hit, stable=True)  # the misses first, in top-k order
    misses = entries - jnp.sum(flat_hit.astype(jnp.int32))
    buckets = miss_buckets(entries)

    def with_bucket(size):
        shapes = tuple(jax.ShapeDtypeStruct((size, *g.shape[2:]), g.dtype) for g in gathered)

        def run(current: Experts) -> Experts:
            places = order[:size]
            real = jnp.arange(size) < misses
            ids = jnp.where(real, indices.reshape(entries)[places], -1).astype(jnp.int32)
            read = io_callback(partial(_host_fetch, fetch, shapes), shapes, layer, ids, ordered=False)
            target = jnp.where(real, places, entries)  # past the end: dropped
            return Experts(*(_scatter_rows(g.reshape(entries, *g.shape[2:]), target, r).reshape(g.shape)
                             for g, r in zip(current, read)))
        return run

    branch = jnp.where(misses == 0, 0, 1 + jnp.searchsorted(jnp.asarray(buckets), misses))
    return lax.switch(branch, [lambda current: current] + [with_bucket(size) for size in buckets], gathered)


def _scatter_rows(rows, target, values):
    """``rows`` with ``rows[target[i]] = values[i]`` (targets past the end dropped). A 16-bit float array
    is written as its bits (XLA's CPU backend writes bfloat16 and float16 rows slowly); the values are
    moved, never converted, so the result is the same either way."""
    if jnp.issubdtype(rows.dtype, jnp.floating) and rows.dtype.itemsize == 2:
        bits = lax.bitcast_convert_type(rows, jnp.uint16).at[target].set(
            lax.bitcast_convert_type(values, jnp.uint16), mode="drop")
        return lax.bitcast_convert_type(bits, rows.dtype)
    return rows.at[target].set(values, mode="drop")
