"""A JAX expert arena that the residency manager writes landed experts into.

Each projection is one ``[L, S, ...]`` array. Writing slots is a jitted
functional update that donates the old buffers, so XLA updates them in place
instead of copying the whole arena; a token boundary's landed experts go in
as one scatter per projection.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from kq_core.contract import TopkRouteShedResult
from kq_core.reports import REPORT_FIELDS
from kq_host.arena import check_arena_arguments, check_payload, check_slot, checked_writes, stacked_shape


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(arrays, layer, slot, payload):
    return {name: arrays[name].at[layer, slot].set(payload[name].astype(arrays[name].dtype)) for name in arrays}


@functools.partial(jax.jit, donate_argnums=0)
def _write_slots(arrays, layers, slots, payloads):
    """``payloads[name]`` is a tuple of n experts' arrays: stacked on the device, one scatter each."""
    return {name: arrays[name].at[layers, slots].set(jnp.stack(payloads[name]).astype(arrays[name].dtype))
            for name in arrays}


def _write_bucket(count: int) -> int:
    """Batches are padded to 1, 2, 4, 8, ... writes, so a run compiles a handful of scatters."""
    return 1 << max(0, count - 1).bit_length()


class JaxArena:
    """``{projection: jax.Array [L, S, ...]}`` with donated single-slot writes.

    Args:
        num_layers, num_slots: L and S.
        shapes: ``{projection: (shape, dtype)}`` of one expert (e.g.
            ``ExpertStore.expert_shapes(layer)``).
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        check_arena_arguments("JaxArena", num_layers, num_slots, shapes)
        for name, (_, dtype) in shapes.items():  # float64 becomes float32 unless JAX runs with x64 enabled
            held = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
            if held != np.dtype(dtype):
                raise ValueError(f"JaxArena: shapes[{name!r}]'s dtype {np.dtype(dtype).name} is not one JAX holds "
                                 f"here (it would hold {held.name}: enable jax_enable_x64, or give that dtype)")
        self.arrays = {name: jnp.zeros((num_layers, num_slots, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}
        # On the CPU, XLA takes a host array into the write without a copy and runs the write after the
        # call returns, so a caller reusing the buffer at once (a recycling host allocator) would change
        # the slot. There the payload is copied first. On a GPU it goes as it is: its transfer is taken to
        # have copied it when the call returns (tests/test_publish_faults.py checks it where it runs).
        self._copy_payloads = any(device.platform == "cpu" for array in self.arrays.values()
                                  for device in array.devices())

    def _host(self, value) -> np.ndarray:
        return np.array(value, copy=True) if self._copy_payloads else np.asarray(value)

    @property
    def shape(self) -> tuple[int, int]:
        return stacked_shape(self.arrays)

    @property
    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (array.shape[2:], np.dtype(array.dtype)) for name, array in self.arrays.items()}

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        """Writes one expert into ``[layer, slot]``; the previous arrays are donated (invalid after).

        Raises:
            ExpertPayloadError: the payload is not one expert of the arena's layout (nothing written).
            ValueError: ``[layer, slot]`` is not a slot of the arena (nothing written).
        """
        check_slot(self.shape, layer, slot)
        check_payload(payload, self.slot_layout)
        # Host arrays and indices go to the jitted write as they are: one transfer each, no eager ops.
        self.arrays = _write_slot(self.arrays, np.int32(layer), np.int32(slot),
                                  {name: self._host(payload[name]) for name in self.arrays})

    def write_slots(self, layers, slots, payloads) -> list[BaseException | None]:
        """Writes n experts at once: each projection's n arrays go to the device as they are and in one
        scatter into the arena (the batch padded to a power of two by repeating its last write); a slot
        written twice holds the later write, as after :meth:`write_slot` in order.

        Args:
            layers, slots: int ``[n]``; payloads: n mappings as for :meth:`write_slot`.

        Returns:
            One error (:func:`kq_host.arena.checked_writes`: that expert not written) or None per write.
        """
        layers, slots, errors = checked_writes(self.shape, layers, slots, payloads, lambda layer: self.slot_layout)
        # A slot written twice keeps its last write: which of a scatter's duplicate indices lands is
        # unspecified (on a GPU the first could: docs/benchmarks.md), so only the last goes in.
        last = {(layers[i], slots[i]): i for i, error in enumerate(errors) if error is None}
        keep = sorted(last.values())
        if keep:
            keep += [keep[-1]] * (_write_bucket(len(keep)) - len(keep))
            self.arrays = _write_slots(
                self.arrays, np.asarray(layers, np.int32)[keep], np.asarray(slots, np.int32)[keep],
                {name: tuple(self._host(payloads[i][name]) for i in keep) for name in self.arrays})
        return errors


def pack_reports(reports):
    """Every layer's report as one array, so the host reads a token's reports back in one transfer
    (inside the jitted step).

    Args:
        reports: per layer, the fields of :mod:`kq_core.reports` in its order (``arena_moe``'s second
            output), each ``[T, K]``; or a ``TopkRouteShedResult`` (``moe_ffn_arena``'s second output),
            whose served entries are those its ``mix`` weights.

    Returns:
        int32 ``[5, L, T, K]``: ids, scores, miss ids, miss scores, served (float fields as float32 bits);
        on the host, ``LayerReport.from_packed`` reads it.
    """
    def fields(report):
        if isinstance(report, TopkRouteShedResult):
            shed = report.shed
            return (report.indices, report.scores, shed.miss_ids, shed.miss_scores,
                    jnp.where(shed.mix > 0, report.scores, 0.0))
        return report

    def as_int32(field):
        if jnp.issubdtype(field.dtype, jnp.floating):
            return lax.bitcast_convert_type(field.astype(jnp.float32), jnp.int32)
        return field.astype(jnp.int32)

    rows = [fields(report) for report in reports]
    return jnp.stack([jnp.stack([as_int32(row[f]) for row in rows]) for f in range(len(REPORT_FIELDS))])
