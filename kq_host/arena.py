"""Where landed experts go: the arena protocol and the host-memory arena.

The JAX and MLX arenas live with their frameworks (``kq_jax.arena``,
``kq_mlx.arena``); the residency manager takes any :class:`Arena`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import numpy as np


class Arena(Protocol):
    """Anything that can take a landed expert into a slot (NumPy, JAX and MLX adapters)."""

    def write_slot(self, layer: int, slot: int, payload: Any) -> None: ...


class NumpyArena:
    """A host-memory arena: ``{projection: array [L, S, ...]}``; writes copy into the slot.

    Safe to write from loader threads (the manager never maps a slot that is
    being written), so a loader can read straight into it and return the byte count.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        self.arrays = {name: np.zeros((num_layers, num_slots, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        for name, value in payload.items():
            self.arrays[name][layer, slot] = value
