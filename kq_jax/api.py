"""The public entry points of kq_jax: arguments checked here, once, then one implementation runs.

``route_shed`` and ``topk_route_shed`` dispatch over the Pallas kernels
(:mod:`kq_jax.route_shed_pallas`, imported on first use) and the jnp reference
(:mod:`kq_jax.reference`); neither checks again.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from kq_core.contract import RouteShedResult, TopkRouteShedResult
from kq_core.validate import check_route_shed_args, check_topk_route_shed_args
from kq_jax.pallas_config import KernelConfig, checked_config
from kq_jax.reference import route_shed_ref, topk_route_shed_ref

Impl = Literal["auto", "pallas", "pallas_interpret", "reference"]
IMPLS = ("auto", "pallas", "pallas_interpret", "reference")


DECODE_ROWS = 16  # route_shed calls of at most this many rows run as the jnp reference on a GPU


def default_impl(rows: int | None = None) -> str:
    """What ``impl="auto"`` runs for a call of ``rows`` rows (None: any).

    On a GPU the compiled Pallas kernel, except ``route_shed`` at decode sizes (at most
    :data:`DECODE_ROWS` rows), where the jnp reference fuses with the graph around it and costs less
    inside a model's step (docs/benchmarks.md); the jnp reference on every other backend. Both give the
    same bits.
    """
    if jax.default_backend() != "gpu":
        return "reference"
    return "reference" if rows is not None and rows <= DECODE_ROWS else "pallas"


def _resolve(op: str, impl: str, config, rows: int | None = None, auto_reference: str | None = None) -> str:
    """``impl`` and ``config`` checked, with ``"auto"`` replaced by :func:`default_impl`'s choice for ``rows``,
    or by the reference where ``auto_reference`` says why the kernel cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if config is not None:
        checked_config(op, config)
    chosen = impl
    if impl == "auto":
        # A launch configuration asks for the kernel: "auto" with one is the kernel on a GPU at any size.
        chosen = "reference" if auto_reference else default_impl(None if config is not None else rows)
    if chosen == "pallas_interpret" and jax.default_backend() == "gpu":
        # Measured: on an H200 (jax 0.11.2) the interpreted kernel writes wrong slots in 6 of 28 golden cases.
        raise ValueError(f"{op}: impl 'pallas_interpret' runs on the CPU backend; on a GPU use 'pallas' (the "
                         f"compiled kernel) or 'reference' (docs/kernels.md)")
    if config is not None and chosen == "reference":
        if impl == "auto":
            why = auto_reference or f"on the {jax.default_backend()} backend"
            raise ValueError(f"{op}: config sets the Pallas kernel's launch; impl 'auto' chose the reference {why}, "
                             f"which runs no kernel")
        raise ValueError(f"{op}: config sets the Pallas kernel's launch; impl 'reference' runs no kernel")
    return chosen


def route_shed(indices, scores, slot_table, *, num_slots: int | None = None, on_miss: str = "shed",
               impl: Impl = "auto", config: KernelConfig | None = None) -> RouteShedResult:
    """Remaps routed experts to arena slots and sheds the non-resident ones (or serves them from a tier).

    Bit-exact with ``shared/spec.json`` on every backend. Traceable under
    ``jax.jit``, ``jax.vmap`` and ``lax.scan``; ``mix`` is differentiable with
    respect to ``scores``.

    Args:
        indices: int32 or uint32 ``[..., K]`` router top-k ids, ``1 <= K <= 64``.
        scores: float32, bfloat16 or float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``; ``slot_table[e] >= 0`` is the arena slot of
            resident expert ``e``, negative means not resident.
        num_slots: the arena's slot count S (a Python int): a table entry
            outside ``[0, S)`` then counts as not resident, so the gathers after
            the op never read past the arena. None: no bound (today's tables).
        on_miss: ``"shed"``: a miss's weight 0, the kept weights scaled to
            carry the row's routed mass (the layer rule ``route_shed`` of
            :mod:`kq_core.rules`; the rule ``shed`` keeps them as they are);
            or ``"tier"``: a miss keeps its score and gets slot
            ``num_slots + id``, its expert's place in a low-precision tier of
            every expert placed after the arena's slots (needs ``num_slots``).
        impl: ``"pallas"`` (the fused kernel, GPU), ``"pallas_interpret"``
            (the same kernel in Pallas' interpreter: any backend, slow),
            ``"reference"`` (pure jnp), or ``"auto"`` (:func:`default_impl`:
            the kernel on a GPU, else the reference).
        config: the kernel's launch parameters (:class:`kq_jax.pallas_config.KernelConfig`),
            for the Pallas impls only; ``None`` fields are chosen by shape.

    Returns:
        ``RouteShedResult(slots, mix, miss_ids, miss_scores)``, each shaped like
        ``indices``: ``slots`` in the dtype of ``indices``, ``mix`` float32,
        ``miss_ids`` int32 (front-packed, -1 padded), ``miss_scores`` float32.

    Raises:
        TypeError / ValueError: a wrong dtype or shape, naming the argument
            (at trace time under ``jax.jit``).
        ValueError: an unknown ``impl``; a ``config`` that is no ``KernelConfig`` or sets a field
            out of its kind; a ``config`` for the reference (``impl="reference"``, or ``"auto"``
            choosing it), naming the impl that chose it.
    """
    # Checked before anything converts: jnp.asarray would silently turn an
    # int64 NumPy array into int32 when x64 is off.
    check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
    num_slots = None if num_slots is None else int(num_slots)
    impl = _resolve("route_shed", impl, config, rows=math.prod(jnp.shape(indices)[:-1]))
    if impl == "reference":
        return route_shed_ref(indices, scores, slot_table, num_slots, on_miss)
    from kq_jax.route_shed_pallas import route_shed_pallas

    return route_shed_pallas(indices, scores, slot_table, interpret=impl == "pallas_interpret", config=config,
                             num_slots=num_slots, on_miss=on_miss)


def topk_route_shed(probs, slot_table, *, top_k: int, normalize: bool = True, on_miss: str = "shed",
                    num_slots: int | None = None, impl: Impl = "auto",
                    config: KernelConfig | None = None) -> TopkRouteShedResult:
    """Routes each row to its top-k experts, renormalises, and sheds the non-resident ones.

    ``route_shed(*topk(probs), slot_table)`` in one launch after the router's
    softmax (one fewer than ``lax.top_k`` then ``route_shed``, and no
    normalisation kernel between them): the op for a MoE layer on an arena at
    decode sizes. The order and normalisation are defined bit for bit in
    :mod:`kq_core.oracle`; on rows without NaN and without both signs of zero the
    order is ``lax.top_k``'s. :func:`kq_jax.reference.topk_normalized_ref`
    is the same two steps in jnp; a layer that keeps every expert can take
    ``lax.top_k`` and :func:`kq_jax.reference.normalize_topk_ref`, as
    ``kq_jax.moe.route`` does.

    Args:
        probs: float32, bfloat16 or float16 ``[..., E]`` router probabilities.
        slot_table: int32 ``[E]``; ``>= 0`` is the arena slot of a resident expert.
        top_k: experts per row, ``1 <= top_k <= min(E, 64)``; the fused kernel
            takes up to 16, past that the top-k runs in XLA before it.
        normalize: renormalise the top-k values to sum to 1, as routers with
            ``norm_topk_prob`` do; ``False`` keeps them as they are.
        on_miss: ``"shed"`` (``route_shed``'s: the layer rule ``route_shed``), ``"substitute"``: each miss
            served by the best resident expert the row did not choose, at the
            miss's weight (kq_core.oracle, step 4), or ``"tier"``: as for
            :func:`route_shed` (needs ``num_slots``).
        num_slots: as for :func:`route_shed`.
        impl: as for :func:`route_shed`. The Pallas kernel implements
            ``normalize=True`` with ``on_miss`` ``"shed"`` or ``"tier"``; other options run the
            reference (``"auto"``) or are refused (``"pallas"``).
        config: the kernel's ``block_rows`` / ``num_warps`` / ``ptx_arith``, for
            the Pallas impls only.

    Returns:
        ``TopkRouteShedResult(indices, scores, shed)``: int32 ids and float32
        renormalised scores ``[..., top_k]``, and ``route_shed`` of them.
        ``scores`` and ``shed.mix`` are differentiable with respect to ``probs``.

    Raises:
        TypeError / ValueError: a wrong dtype, shape or option, naming the argument
            (at trace time under ``jax.jit``); ``impl`` and ``config`` as for :func:`route_shed`;
            ``impl="pallas"`` or ``"pallas_interpret"`` with options the kernel does not implement.
    """
    check_topk_route_shed_args(probs, slot_table, top_k, normalize=normalize, on_miss=on_miss, num_slots=num_slots)
    num_slots = None if num_slots is None else int(num_slots)
    kernel_options = normalize and on_miss in ("shed", "tier")
    impl = _resolve("topk_route_shed", impl, config,
                    auto_reference=None if kernel_options else f"for normalize={normalize}, on_miss={on_miss!r}")
    if impl == "reference":
        return topk_route_shed_ref(probs, slot_table, top_k=top_k, normalize=bool(normalize), on_miss=on_miss,
                                   num_slots=num_slots)
    if not kernel_options:
        raise ValueError(f"topk_route_shed: the Pallas kernel implements normalize=True, on_miss 'shed' or 'tier'; "
                         f"got normalize={normalize}, on_miss={on_miss!r} (use impl='reference' or 'auto')")
    from kq_jax.topk_route_shed_pallas import topk_route_shed_pallas

    return topk_route_shed_pallas(probs, slot_table, top_k=int(top_k), interpret=impl == "pallas_interpret",
                                  config=config, num_slots=num_slots, on_miss=on_miss)


def route_shed_reference(indices, scores, slot_table, *, num_slots: int | None = None,
                         on_miss: str = "shed") -> RouteShedResult:
    """:func:`route_shed` with ``impl="reference"``: the pure-jnp version, on any backend."""
    return route_shed(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss, impl="reference")


def topk_route_shed_reference(probs, slot_table, *, top_k: int, normalize: bool = True, on_miss: str = "shed",
                              num_slots: int | None = None) -> TopkRouteShedResult:
    """:func:`topk_route_shed` with ``impl="reference"``: the pure-jnp version, on any backend."""
    return topk_route_shed(probs, slot_table, top_k=top_k, normalize=normalize, on_miss=on_miss,
                           num_slots=num_slots, impl="reference")
