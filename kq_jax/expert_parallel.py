"""The arena MoE layer sharded over devices: tokens over a data axis, the arena's slots over an expert axis.

Each device of a ``(data, expert)`` mesh holds ``S / n_expert`` of the arena's
S slots (global slot ``g`` lives on expert-axis device ``g // (S / n_expert)``)
and the tokens of its data shard, which every device along the expert axis
sees whole. A step, inside ``shard_map``:

1. every device routes its tokens (``topk_route_shed`` against the replicated
   slot table; the same bits on each device of an expert-axis group, so no
   collective is needed to agree on the routing);
2. each device runs the experts of the entries whose slot it holds, and writes
   ``-0.0`` for the others;
3. one ``psum`` over the expert axis combines the per-entry outputs
   ``[T_shard, k, D]``. Exactly one device holds each entry and ``-0.0`` is the
   additive identity of every float (``x + -0.0 == x`` bit for bit, ``+0.0``
   included), so the sum is exact in any reduction order;
4. each device weighs the entries and sums over k in the single-device
   layer's order, so the output has :func:`kq_jax.arena_moe.moe_ffn_arena`'s bits.

The tokens need no dispatch collective (they are already on every device of
their expert-axis group); the combine moves ``k`` times the bytes of a partial
sum ``[T_shard, D]``, the price of bits that do not depend on the mesh:
summing per-device partial sums would round in a mesh-dependent order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kq_core.contract import TopkRouteShedResult
from kq_jax.api import topk_route_shed
from kq_jax.moe import Experts, combine, experts_apply, router_probs


def arena_sharding(mesh: Mesh, expert_axis: str = "expert") -> Experts:
    """The ``NamedSharding`` of each arena array: slots split over ``expert_axis``."""
    sharding = NamedSharding(mesh, P(expert_axis, None, None))
    return Experts(sharding, sharding, sharding)


def moe_ffn_arena_sharded(x, router_w, arena: Experts, slot_table, *, top_k: int, mesh: Mesh,
                          data_axis: str | None = "data", expert_axis: str = "expert",
                          impl: str = "auto") -> tuple[jax.Array, TopkRouteShedResult]:
    """:func:`kq_jax.arena_moe.moe_ffn_arena` on a mesh, with its bits.

    Args:
        x: ``[T, D]`` hidden states, rows sharded over ``data_axis``
            (``T`` divisible by its size).
        router_w: ``[D, E]``, replicated.
        arena: :class:`~kq_jax.moe.Experts` with ``N = S`` slots, split over
            ``expert_axis`` (``S`` divisible by its size; :func:`arena_sharding`).
        slot_table: int32 ``[E]``, global slots (-1 = not resident), replicated.
        top_k: experts per token.
        mesh: the device mesh holding both axes.
        data_axis: the mesh axis (or tuple of axes) of the tokens, or None to replicate them; never
            ``expert_axis``.
        expert_axis: the mesh axis of the slots.
        impl: ``topk_route_shed``'s; ``"auto"`` picks by the mesh's devices
            (the kernel on GPUs, the reference elsewhere), not the default backend.

    Returns:
        ``(y [T, D], TopkRouteShedResult)``, rows sharded as ``x``.

    Raises:
        ValueError: an axis the mesh lacks, ``data_axis`` holding ``expert_axis``, or slots that do not split
            over ``expert_axis``.
        TypeError: ``x`` or ``router_w`` of a dtype the router does not take (:func:`kq_jax.moe.router_probs`).
    """
    for name, axis in (("expert_axis", expert_axis), ("data_axis", data_axis)):
        names = () if axis is None else axis if isinstance(axis, tuple) and name == "data_axis" else (axis,)
        if any(part not in mesh.shape for part in names):
            raise ValueError(f"moe_ffn_arena_sharded: {name} {axis!r} is not an axis (or a tuple of axes, for "
                             f"data_axis) of the mesh {tuple(mesh.shape)}")
    if expert_axis in (data_axis if isinstance(data_axis, tuple) else (data_axis,)):
        raise ValueError(f"moe_ffn_arena_sharded: data_axis {data_axis!r} must not hold expert_axis {expert_axis!r}: "
                         f"the slots' outputs are summed over expert_axis, so each of its devices must hold the "
                         f"same tokens")
    num_slots = arena.gate.shape[0]
    if num_slots % mesh.shape[expert_axis]:
        raise ValueError(f"arena: {num_slots} slots do not split over the {mesh.shape[expert_axis]} devices "
                         f"of mesh axis {expert_axis!r}")
    if impl == "auto":
        impl = "pallas" if mesh.devices.flat[0].platform == "gpu" else "reference"
    rows = P(data_axis, None)
    slots = P(expert_axis, None, None)

    def step(x, router_w, arena, slot_table):
        local_slots = arena.gate.shape[0]
        routing = topk_route_shed(router_probs(x, router_w), slot_table, top_k=top_k,
                                  num_slots=local_slots * lax.axis_size(expert_axis), impl=impl)
        # A shed entry's slot is -1; the single-device layer's gather reads slot S - 1 for it
        # (jnp's negative index) at weight 0, and so does this one, on the device holding S - 1.
        global_slot = routing.shed.slots % (local_slots * lax.axis_size(expert_axis))
        first = lax.axis_index(expert_axis) * local_slots
        mine = (global_slot >= first) & (global_slot < first + local_slots)
        y = experts_apply(x, arena, jnp.where(mine, global_slot - first, 0))
        y = lax.psum(jnp.where(mine[..., None], y, jnp.array(-0.0, y.dtype)), expert_axis)
        return combine(y, routing.shed.mix), routing

    # check_vma off: a pallas_call's outputs carry no varying-axes type to check.
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(rows, P(), Experts(slots, slots, slots), P()),
                            out_specs=(rows, rows), check_vma=False)
    return sharded(x, router_w, arena, slot_table)
