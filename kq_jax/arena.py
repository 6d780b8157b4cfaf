"""A JAX expert arena that the residency manager writes landed experts into.

Each projection is one ``[L, S, ...]`` array. Writing a slot is a jitted
functional update that donates the old buffers, so XLA updates them in place
instead of copying the whole arena per loaded expert.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kq_host.arena import check_payload


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(arrays, layer, slot, payload):
    return {name: arrays[name].at[layer, slot].set(payload[name].astype(arrays[name].dtype)) for name in arrays}


class JaxArena:
    """``{projection: jax.Array [L, S, ...]}`` with donated single-slot writes.

    Args:
        num_layers, num_slots: L and S.
        shapes: ``{projection: (shape, dtype)}`` of one expert (e.g.
            ``ExpertStore.expert_shapes(layer)``).
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        self.arrays = {name: jnp.zeros((num_layers, num_slots, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}

    @property
    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (array.shape[2:], np.dtype(array.dtype)) for name, array in self.arrays.items()}

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        """Writes one expert into ``[layer, slot]``; the previous arrays are donated (invalid after).

        Raises:
            ExpertPayloadError: the payload is not one expert of the arena's layout (nothing written).
        """
        check_payload(payload, self.slot_layout)
        # Host arrays and indices go to the jitted write as they are: one transfer each, no eager ops.
        self.arrays = _write_slot(self.arrays, np.int32(layer), np.int32(slot),
                                  {name: np.asarray(payload[name]) for name in self.arrays})
