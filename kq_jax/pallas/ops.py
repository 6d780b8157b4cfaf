"""The Pallas ops: launches of the kernels, their gradients, and the K > 16 top-k fallback.

``route_shed_pallas`` and ``topk_route_shed_pallas`` trust their arguments:
``kq_jax.route_shed`` and ``kq_jax.topk_route_shed`` check them first. The
kernels are in :mod:`kq_jax.pallas.route_shed_kernel` and
:mod:`kq_jax.pallas.topk_kernel`, their launch configuration in
:mod:`kq_jax.pallas.config`.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kq_core.contract import RouteShedResult, TopkRouteShedResult
from kq_jax.pallas.config import (
    MAX_UNROLLED_K,
    KernelConfig,
    block_config,
    row_bucket,
    topk_block_config,
)
from kq_jax.partition import rowwise
from kq_jax.pallas.route_shed_kernel import route_shed_kernel, route_shed_lanes_kernel
from kq_jax.pallas.topk_kernel import topk_route_shed_kernel
from kq_jax.reference import route_shed_ref, topk_normalized_ref, topk_route_shed_ref


def _launch_rows(rows: int, config: KernelConfig | None) -> int:
    """The rows a launch covers: :func:`row_bucket`'s, unless ``config`` asks for the exact count."""
    return rows if config is not None and config.row_buckets is False else row_bucket(rows)


def _pad_rows(x, rows: int):
    """``x`` ``[n, X]`` with zero rows appended up to ``rows``."""
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _on_row_bucket(op, row_args, config: KernelConfig | None):
    """``op(*row_args)``; called eagerly, on the rows padded to their bucket (and the padding dropped after).

    An eager call then reuses the executable compiled for its bucket instead
    of compiling the kernel for its exact row count. Traced (under a jit),
    ``op`` runs as it is, and each device pads its own rows in ``_pallas_forward``.
    """
    if any(isinstance(a, jax.core.Tracer) for a in row_args):
        return op(*row_args)
    shape = row_args[0].shape
    rows = math.prod(shape[:-1])
    launch_rows = _launch_rows(rows, config)
    outputs = op(*(_pad_rows(jnp.reshape(a, (rows, a.shape[-1])), launch_rows) for a in row_args))
    return jax.tree.map(lambda o: o[:rows].reshape(shape[:-1] + o.shape[-1:]), outputs)


def _pallas_forward(indices, scores, slot_table, *, interpret: bool, config: KernelConfig | None,
                    num_slots: int | None) -> RouteShedResult:
    top_k = indices.shape[-1]
    rows = indices.size // top_k
    launch_rows = _launch_rows(rows, config)
    outputs = _route_shed_launch(_pad_rows(indices.reshape(rows, top_k), launch_rows),
                                 _pad_rows(scores.reshape(rows, top_k), launch_rows), slot_table,
                                 interpret=interpret, config=config, num_slots=num_slots)
    return RouteShedResult(*(o[:rows].reshape(indices.shape) for o in outputs))


# Jitted on the launch's [rows, K], so that every row count of one bucket, and
# a program calling the op once per MoE layer, trace and lower the kernel once.
@functools.partial(jax.jit, static_argnames=("interpret", "config", "num_slots"))
def _route_shed_launch(indices, scores, slot_table, *, interpret: bool, config: KernelConfig | None,
                       num_slots: int | None) -> RouteShedResult:
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
                  unsigned_ids=indices.dtype == jnp.uint32, ptx_arith=ptx_arith, num_slots=num_slots)
    if entry_lanes:
        kernel = functools.partial(route_shed_lanes_kernel, **params)
    else:
        kernel = functools.partial(route_shed_kernel, tiled_io=tiled_io, **params)
    outputs = _launch(kernel, shapes, (indices.reshape(-1), scores.reshape(-1), slot_table),
                      name=f"route_shed_k{top_k}", programs=pl.cdiv(rows, block_rows), num_warps=num_warps,
                      interpret=interpret)
    return RouteShedResult(*(o.reshape(indices.shape) for o in outputs))


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


@functools.partial(rowwise, num_row_args=2)
def _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots):
    return _pallas_forward(indices, scores, slot_table, interpret=interpret, config=config, num_slots=num_slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _route_shed_diff(indices, scores, slot_table, interpret, config, num_slots):
    return _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots)


def _route_shed_fwd(indices, scores, slot_table, interpret, config, num_slots):
    outputs = _route_shed_rows(indices, scores, slot_table, interpret, config, num_slots)
    return outputs, (indices, scores, slot_table)


def _route_shed_bwd(interpret, config, num_slots, residuals, cotangents):
    # The backward pass is autodiff of the pure-jnp reference, so the kernel's
    # gradient is the reference's gradient bit for bit; it launches no kernel.
    del interpret, config
    indices, scores, slot_table = residuals
    _, pullback = jax.vjp(lambda s: route_shed_ref(indices, s, slot_table, num_slots).mix, scores)
    (d_scores,) = pullback(cotangents.mix)
    return None, d_scores, None


_route_shed_diff.defvjp(_route_shed_fwd, _route_shed_bwd)


def route_shed_pallas(indices, scores, slot_table, *, interpret: bool = False, config: KernelConfig | None = None,
                      num_slots: int | None = None) -> RouteShedResult:
    """``route_shed`` in one fused Pallas kernel launch.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]``.
        slot_table: int32 ``[E]``; negative = not resident.
        interpret: run the kernel in Pallas' interpreter (any backend, slow).
        config: launch parameters overriding :func:`block_config`'s choice.

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)`` shaped like ``indices``;
        ``mix`` is differentiable with respect to ``scores``.
    """
    return _on_row_bucket(lambda i, s: _route_shed_diff(i, s, slot_table, interpret, config, num_slots),
                          (indices, scores), config)


def _topk_forward(probs, slot_table, *, top_k: int, interpret: bool, config: KernelConfig | None,
                  num_slots: int | None) -> TopkRouteShedResult:
    num_experts = probs.shape[-1]
    rows = probs.size // num_experts
    outputs = _topk_launch(_pad_rows(probs.reshape(rows, num_experts), _launch_rows(rows, config)), slot_table,
                           top_k=top_k, interpret=interpret, config=config, num_slots=num_slots)
    return jax.tree.map(lambda o: o[:rows].reshape(probs.shape[:-1] + (top_k,)), outputs)


@functools.partial(jax.jit, static_argnames=("top_k", "interpret", "config", "num_slots"))
def _topk_launch(probs, slot_table, *, top_k: int, interpret: bool, config: KernelConfig | None,
                 num_slots: int | None) -> TopkRouteShedResult:
    rows, num_experts = probs.shape
    out_shape = (rows, top_k)
    dtypes = (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.float32)
    if rows == 0:
        outputs = [jnp.zeros(out_shape, d) for d in dtypes]
    else:
        block_rows, num_warps, _, ptx_arith, _, _ = topk_block_config(rows, num_experts, config, interpret=interpret)
        kernel = functools.partial(topk_route_shed_kernel, rows=rows, num_experts=num_experts, top_k=top_k,
                                   block_rows=block_rows, ptx_arith=ptx_arith, num_slots=num_slots)
        outputs = _launch(kernel, [jax.ShapeDtypeStruct((rows * top_k,), d) for d in dtypes],
                          (probs.reshape(-1), slot_table), name=f"topk_route_shed_k{top_k}",
                          programs=pl.cdiv(rows, block_rows), num_warps=num_warps, interpret=interpret)
        outputs = [o.reshape(out_shape) for o in outputs]
    indices, scores, *shed = outputs
    return TopkRouteShedResult(indices, scores, RouteShedResult(*shed))


@functools.partial(rowwise, num_row_args=1)
def _topk_rows(probs, slot_table, top_k, interpret, config, num_slots):
    return _topk_forward(probs, slot_table, top_k=top_k, interpret=interpret, config=config, num_slots=num_slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _topk_route_shed_diff(probs, slot_table, top_k, interpret, config, num_slots):
    return _topk_rows(probs, slot_table, top_k, interpret, config, num_slots)


def _topk_route_shed_fwd(probs, slot_table, top_k, interpret, config, num_slots):
    outputs = _topk_rows(probs, slot_table, top_k, interpret, config, num_slots)
    return outputs, (probs, slot_table)


def _topk_route_shed_bwd(top_k, interpret, config, num_slots, residuals, cotangents):
    # As for route_shed: the reference's autodiff, bit for bit, and no kernel.
    del interpret, config
    probs, slot_table = residuals

    def differentiable(p):
        routed = topk_route_shed_ref(p, slot_table, top_k=top_k, num_slots=num_slots)
        return routed.scores, routed.shed.mix

    _, pullback = jax.vjp(differentiable, probs)
    (d_probs,) = pullback((cotangents.scores, cotangents.shed.mix))
    return d_probs, None


_topk_route_shed_diff.defvjp(_topk_route_shed_fwd, _topk_route_shed_bwd)


def topk_route_shed_pallas(probs, slot_table, *, top_k: int, interpret: bool = False,
                           config: KernelConfig | None = None, num_slots: int | None = None) -> TopkRouteShedResult:
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
        ``TopkRouteShedResult(indices, scores, shed)``, each array ``[..., top_k]``;
        ``scores`` and ``shed.mix`` are differentiable with respect to ``probs``.
    """
    if top_k > MAX_UNROLLED_K:
        indices, scores = topk_normalized_ref(probs, top_k=top_k)
        shed = route_shed_pallas(indices, scores, slot_table, interpret=interpret, config=config, num_slots=num_slots)
        return TopkRouteShedResult(indices, scores, shed)
    return _on_row_bucket(lambda p: _topk_route_shed_diff(p, slot_table, int(top_k), interpret, config, num_slots),
                          (probs,), config)

