"""Row-wise sharding and batching rules for the ops' custom calls.

A ``pallas_call`` is a custom call that XLA's partitioner cannot split: on
sharded rows it gathers every row onto every device and runs the whole kernel
on each; XLA's ``top_k`` does the same on the CPU. Both ops are row-wise (each
output row depends on its input row and the replicated slot table), so
:func:`rowwise` wraps a kernel launch (or a ``top_k``) in
``custom_partitioning`` with that rule: the leading dimensions keep whatever
sharding they arrive with, the last dimension and the slot table are
replicated, and each device launches the kernel on its own rows. No
collective is needed unless the caller shards the last dimension or the table,
which the rule then replicates.

``custom_partitioning`` has no batching rule, so the wrapper also carries a
``custom_vmap`` rule: a batch axis is more rows for the same table (one launch
over all of them); a batched slot table runs one launch per table under
``lax.map``.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _leading_spec(sharding, ndim: int) -> tuple:
    """The sharding of a row argument's leading dimensions (all but the last)."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return (spec + (None,) * ndim)[:ndim - 1]


def rowwise(forward, num_row_args: int, num_tables: int = 1):
    """Wraps ``forward(*row_args, *tables, *static)`` so sharded rows stay sharded, under jit, vmap and scan.

    Args:
        forward: a kernel launch whose first ``num_row_args`` arguments are
            ``[..., X]`` row arrays sharing their leading dimensions, the next
            ``num_tables`` the ``[E]`` slot table (replicated), the rest
            hashable static options; it returns a pytree of ``[..., Y]`` row
            arrays with those leading dimensions.
        num_row_args: how many row arguments lead.
        num_tables: 1 (a slot table follows the rows) or 0.

    Returns:
        A function with ``forward``'s signature and bits.
    """
    num_arrays = num_row_args + num_tables
    num_static = len(inspect.signature(forward).parameters) - num_arrays
    static_argnums = tuple(range(num_arrays, num_arrays + num_static))
    partitioned = custom_partitioning(forward, static_argnums=static_argnums)

    def shardings(mesh, arg_shapes, result_shape):
        first = arg_shapes[0]
        leading = _leading_spec(first.sharding, len(first.shape))

        def row_sharding(shape):
            return NamedSharding(mesh, PartitionSpec(*leading, *(None,) * (len(shape.shape) - len(leading))))

        args = tuple(row_sharding(a) for a in arg_shapes[:num_row_args])
        args += (NamedSharding(mesh, PartitionSpec()),) * num_tables
        return args, jax.tree.map(row_sharding, result_shape)

    def infer(*static_and_shapes):
        mesh, arg_shapes, result_shape = static_and_shapes[num_static:]
        return shardings(mesh, arg_shapes, result_shape)[1]

    def partition(*static_and_shapes):
        static = static_and_shapes[:num_static]
        mesh, arg_shapes, result_shape = static_and_shapes[num_static:]
        args, results = shardings(mesh, arg_shapes, result_shape)
        return mesh, lambda *arrays: forward(*arrays, *static), results, args

    def rule(*static_and_types):
        # Shardy: the leading dimensions pass through; no last dimension and
        # not the table is split.
        num_results = len(static_and_types[-1])
        rows = [f"... x{i}" for i in range(num_row_args)]
        results = [f"... y{i}" for i in range(num_results)]
        tables = ["e"] * num_tables
        replicated = tuple(f"x{i}" for i in range(num_row_args)) + tuple(tables)
        replicated += tuple(f"y{i}" for i in range(num_results))
        return ", ".join(rows + tables) + " -> " + ", ".join(results), dict(need_replication_factors=replicated)

    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)

    @functools.wraps(forward)
    def call(*args):
        arrays, static = args[:num_arrays], args[num_arrays:]

        @jax.custom_batching.custom_vmap
        def op(*arrays):
            return partitioned(*arrays, *static)

        @op.def_vmap
        def op_vmap(axis_size, in_batched, *arrays):
            rows = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                    for a, b in zip(arrays[:num_row_args], in_batched)]
            tables = arrays[num_row_args:]
            if any(in_batched[num_row_args:]):
                result = jax.lax.map(lambda per_table: op(*per_table), (*rows, *tables))
            else:
                result = op(*rows, *tables)
            return result, jax.tree.map(lambda _: True, result)

        return op(*arrays)

    # Jitted: an eager call then traces the wrappers (and the kernel inside) once per shape, not per call.
    return jax.jit(call, static_argnums=static_argnums)
