"""An MLX expert arena that the residency manager writes landed experts into (in place)."""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from kq_core.contract import NUMPY_DTYPES
from kq_core.validate import dtype_name
from kq_host.arena import check_arena_arguments, check_payload, check_slot, checked_writes, stacked_shape
from kq_mlx.route_shed_mlx import MX_DTYPES, from_numpy

NUMPY_DTYPES_OF_MX = {mx_dtype: NUMPY_DTYPES.get(name, np.dtype(name)) for name, mx_dtype in MX_DTYPES.items()}


class MlxArena:
    """``{projection: mx.array [L, S, ...]}``; a slot write is an in-place slice update.

    Args:
        num_layers, num_slots: L and S.
        shapes: ``{projection: (shape, dtype)}`` of one expert.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        check_arena_arguments("MlxArena", num_layers, num_slots, shapes)
        self.arrays = {name: mx.zeros((num_layers, num_slots, *shape), dtype=MX_DTYPES[dtype_name(np.empty(0, dtype))])
                       for name, (shape, dtype) in shapes.items()}

    @property
    def shape(self) -> tuple[int, int]:
        return stacked_shape(self.arrays)

    @property
    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (tuple(array.shape[2:]), NUMPY_DTYPES_OF_MX[array.dtype]) for name, array in self.arrays.items()}

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        """Writes one expert into ``[layer, slot]`` in place.

        Raises:
            ExpertPayloadError: the payload is not one expert of the arena's layout (nothing written).
            ValueError: ``[layer, slot]`` is not a slot of the arena (nothing written).
        """
        check_slot(self.shape, layer, slot)
        check_payload(payload, self.slot_layout)
        self._assign(layer, slot, payload)
        # Evaluated before it returns: the slot holds the expert before its table entry is published, and the
        # next write updates this one's output in place (built while this one was queued, it copied the array).
        mx.eval(*self.arrays.values())

    def write_slots(self, layers, slots, payloads) -> list[BaseException | None]:
        """Writes n experts, evaluated once; one error (:func:`kq_host.arena.checked_writes`: that expert not
        written) or None per write."""
        layers, slots, errors = checked_writes(self.shape, layers, slots, payloads, lambda layer: self.slot_layout)
        for layer, slot, payload, error in zip(layers, slots, payloads, errors):
            if error is None:
                self._assign(layer, slot, payload)
        mx.eval(*self.arrays.values())
        return errors

    def _assign(self, layer: int, slot: int, payload) -> None:
        for name, value in payload.items():
            self.arrays[name][layer, slot] = from_numpy(np.asarray(value))
