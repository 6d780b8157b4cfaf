"""An MLX expert arena that the residency manager writes landed experts into (in place)."""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from kq_core.validate import dtype_name
from kq_mlx.route_shed_mlx import MX_DTYPES, from_numpy


class MlxArena:
    """``{projection: mx.array [L, S, ...]}``; a slot write is an in-place slice update.

    Args:
        num_layers, num_slots: L and S.
        shapes: ``{projection: (shape, dtype)}`` of one expert.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        self.arrays = {name: mx.zeros((num_layers, num_slots, *shape), dtype=MX_DTYPES[dtype_name(np.empty(0, dtype))])
                       for name, (shape, dtype) in shapes.items()}

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        for name, value in payload.items():
            self.arrays[name][layer, slot] = from_numpy(np.asarray(value))
        # The slot must hold the expert before its table entry is published.
        mx.eval(*self.arrays.values())
