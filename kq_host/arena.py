"""Where landed experts go: the arena protocol and the host-memory arena.

The JAX and MLX arenas live with their frameworks (``kq_jax.arena``,
``kq_mlx.arena``); the residency manager takes any :class:`Arena`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class Arena(Protocol):
    """Anything that can take a landed expert into a slot (NumPy, JAX and MLX adapters).

    An arena may also define ``write_slots(layers, slots, payloads)``: the landed experts of one
    boundary at once (one scatter per projection on a device), every payload checked first, the valid
    ones written; it returns one exception (a refused payload) or None per write. And ``shape``,
    ``(layers, slots)``: a manager of another shape is then refused when it is made.
    """

    def write_slot(self, layer: int, slot: int, payload: Any) -> None: ...


def write_landed(arena: Arena, layers: np.ndarray, slots: np.ndarray,
                 payloads: Sequence[Any]) -> list[BaseException | None]:
    """Writes landed experts into ``arena``: through its ``write_slots`` where it has one, else one
    ``write_slot`` each. Returns one exception (that write failed, its slot untouched) or None per write."""
    batched = getattr(arena, "write_slots", None)
    if batched is not None:
        return batched(layers, slots, payloads)
    errors: list[BaseException | None] = []
    for layer, slot, payload in zip(layers.tolist(), slots.tolist(), payloads):
        try:
            arena.write_slot(layer, slot, payload)
            errors.append(None)
        except BaseException as error:  # noqa: BLE001 - the manager reports it as the read's failure
            errors.append(error)
    return errors


def checked_payloads(layout, payloads: Sequence[Any]) -> list[BaseException | None]:
    """:func:`check_payload` over a batch: one :class:`ExpertPayloadError` or None per payload."""
    errors: list[BaseException | None] = []
    for payload in payloads:
        try:
            check_payload(payload, layout)
            errors.append(None)
        except ExpertPayloadError as error:
            errors.append(error)
    return errors


def stacked_shape(arrays: Mapping[str, Any]) -> tuple[int, int]:
    """``(layers, slots)`` of an arena's ``{projection: [L, S, ...]}`` arrays."""
    layers, slots = next(iter(arrays.values())).shape[:2]
    return int(layers), int(slots)


class ExpertPayloadError(ValueError):
    """A payload is not one expert of the arena's layout; the message says which projection and why."""


def check_payload(payload, slot_layout: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
    """Raises :class:`ExpertPayloadError` unless ``payload`` is exactly one expert of ``slot_layout``.

    Every projection of the layout and no other, each an array of the slot's shape whose dtype casts
    to the slot's without loss (bf16 or f16 into an f32 arena; never f32 into bf16). Arrays are not
    broadcast: a scalar or a ``[1, n]`` row is refused.

    Args:
        payload: ``{projection: array}`` as a loader returns it.
        slot_layout: ``{projection: (shape, dtype)}`` of one slot.
    """
    if not isinstance(payload, Mapping):
        raise ExpertPayloadError(f"payload must be a mapping of projection to array, got {type(payload).__name__}")
    missing, extra = set(slot_layout) - set(payload), set(payload) - set(slot_layout)
    if missing or extra:
        raise ExpertPayloadError(f"payload projections differ from the arena's: missing {sorted(missing)}, "
                                 f"unexpected {sorted(extra)}")
    for name, (shape, dtype) in slot_layout.items():
        value = payload[name]
        got_shape, got_dtype = tuple(np.shape(value)), _numpy_dtype(name, value)
        if got_shape != tuple(shape):
            raise ExpertPayloadError(f"payload {name} has shape {list(got_shape)}, the slot {list(shape)}")
        if not np.can_cast(got_dtype, np.dtype(dtype), casting="safe"):
            raise ExpertPayloadError(f"payload {name} has dtype {got_dtype.name}, which does not cast to the "
                                     f"slot's {np.dtype(dtype).name} without loss")


def _numpy_dtype(name: str, value) -> np.dtype:
    """The NumPy dtype of an array of any framework (NumPy, JAX, MLX: ``mlx.core.float32`` is ``float32``)."""
    dtype = getattr(value, "dtype", type(value))
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    try:
        return np.dtype(str(dtype).rsplit(".", 1)[-1])
    except TypeError:
        raise ExpertPayloadError(f"payload {name} has dtype {dtype}, which is no NumPy dtype") from None


class NumpyArena:
    """A host-memory arena: ``{projection: array [L, S, ...]}``; writes copy into the slot.

    Safe to write from loader threads (the manager never maps a slot that is
    being written), so a loader can read straight into it and return the byte count.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        self.arrays = {name: np.zeros((num_layers, num_slots, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}

    @property
    def shape(self) -> tuple[int, int]:
        return stacked_shape(self.arrays)

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        """Copies one expert into ``[layer, slot]``; :class:`ExpertPayloadError` (slot untouched) if it is not one."""
        check_payload(payload, self.slot_layout)
        for name, value in payload.items():
            self.arrays[name][layer, slot] = value

    @property
    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (array.shape[2:], array.dtype) for name, array in self.arrays.items()}
