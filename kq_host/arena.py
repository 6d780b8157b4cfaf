"""Where landed experts go: the arena protocol and the host-memory arena.

The JAX and MLX arenas live with their frameworks (``kq_jax.arena``,
``kq_mlx.arena``); the residency manager takes any :class:`Arena`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from kq_core.validate import is_int


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


def check_slot(shape: tuple[int, int], layer, slot) -> None:
    """ValueError naming the index unless ``[layer, slot]`` is a slot of an arena of ``shape``
    (``(layers, slots)``): ints in range (a negative one would write from the end, one past it nowhere)."""
    for name, value, count in (("layer", layer, shape[0]), ("slot", slot, shape[1])):
        if not is_int(value) or not 0 <= value < count:
            raise ValueError(f"write_slot: {name} must be an int in [0, {count}), got {value!r}")


def checked_writes(shape: tuple[int, int], layers, slots, payloads: Sequence[Any],
                   layout_of: Callable[[int], Mapping]) -> tuple[list, list, list[BaseException | None]]:
    """A batch of writes checked as a write of one is (:func:`check_slot`, then :func:`check_payload` against
    ``layout_of(layer)``, the layer's slot layout): ``(layers, slots, errors)`` as lists, one exception (that
    write not to be made) or None per write.

    Raises:
        ValueError: ``layers`` and ``slots`` are not 1-D integer arrays of one write each, as many as
            ``payloads`` (nothing is written then).
    """
    layers, slots, payloads = np.asarray(layers), np.asarray(slots), list(payloads)
    if (layers.ndim != 1 or slots.ndim != 1 or not len(layers) == len(slots) == len(payloads)
            or (len(layers) and not (np.issubdtype(layers.dtype, np.integer)
                                     and np.issubdtype(slots.dtype, np.integer)))):
        raise ValueError(f"write_slots: layers and slots must be 1-D integer arrays of one write each, as many as "
                         f"the payloads; got {layers.dtype} {list(layers.shape)}, {slots.dtype} "
                         f"{list(slots.shape)} and {len(payloads)} payloads")
    layer_list, slot_list = layers.tolist(), slots.tolist()
    errors: list[BaseException | None] = [None] * len(payloads)
    if not payloads:
        return layer_list, slot_list, errors
    outside = (layers < 0) | (layers >= shape[0]) | (slots < 0) | (slots >= shape[1])
    for j in np.flatnonzero(outside).tolist():
        try:
            check_slot(shape, layer_list[j], slot_list[j])
        except ValueError as error:
            errors[j] = error
    # One check per kind of payload in the batch: a payload of a type, projections and arrays (their types,
    # shapes and dtypes) that passed check_payload against the layer's layout passes again.
    layouts: dict[int, tuple[Mapping, frozenset, Any]] = {}  # each layer's, asked for once
    passed: set = set()
    for j, (layer, payload) in enumerate(zip(layer_list, payloads)):
        if errors[j] is not None:
            continue
        layout, names, layout_key = layouts.get(layer) or layouts.setdefault(layer, _keyed_layout(layout_of(layer)))
        kind = _payload_kind(payload, names)
        if kind is not None and (layout_key, kind) in passed:
            continue
        try:
            check_payload(payload, layout)
        except ValueError as error:  # ExpertPayloadError is one
            errors[j] = error
            continue
        if kind is not None:
            passed.add((layout_key, kind))
    return layer_list, slot_list, errors


def _keyed_layout(layout: Mapping) -> tuple[Mapping, frozenset, Any]:
    """A slot layout, its projections' names, and a key equal for layouts written alike (one object's identity
    where the layout cannot be hashed; kept alive beside it)."""
    try:
        key = tuple((name, tuple(shape), dtype) for name, (shape, dtype) in layout.items())
        hash(key)
    except (TypeError, ValueError):
        key = id(layout)
    return layout, frozenset(layout), key


def _payload_kind(payload, names: frozenset):
    """What :func:`check_payload` decides on, as a key: the payload's type, and each projection's array type,
    shape and dtype, in the layout's names; None where it cannot be keyed (not a dict with exactly those
    names, an array with no shape or dtype, or one that is not hashable), so it is checked on its own."""
    if type(payload) is not dict or payload.keys() != names:
        return None
    try:
        kind = tuple((name, type(value), tuple(value.shape), value.dtype) for name, value in payload.items())
        hash(kind)
    except (AttributeError, TypeError):
        return None
    return kind


def check_arena_arguments(kind: str, num_layers, num_slots, shapes) -> None:
    """An arena's constructor arguments: ``num_layers`` and ``num_slots`` ints >= 1, ``shapes`` a non-empty
    ``{projection: (shape, dtype)}`` of non-negative int dimensions; ValueError naming the argument."""
    for name, value in (("num_layers", num_layers), ("num_slots", num_slots)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{kind}: {name} must be an int >= 1, got {value!r}")
    if not isinstance(shapes, Mapping) or not shapes:
        raise ValueError(f"{kind}: shapes must be a non-empty mapping projection -> (shape, dtype), got {shapes!r}")
    for name, entry in shapes.items():
        try:
            shape, dtype = entry
            np.dtype(dtype)
            ok = all(is_int(d) and d >= 0 for d in shape)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{kind}: shapes[{name!r}] must be (shape of ints >= 0, dtype), got {entry!r}")


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


# A batch of writes of at most this many bytes a projection is stacked and scattered at once (NumpyArena).
_STACKED_WRITE_BYTES = 1 << 22


class NumpyArena:
    """A host-memory arena: ``{projection: array [L, S, ...]}``; writes copy into the slot.

    Safe to write from loader threads (the manager never maps a slot that is
    being written), so a loader can read straight into it and return the byte count.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: Mapping[str, tuple[tuple[int, ...], Any]]):
        check_arena_arguments("NumpyArena", num_layers, num_slots, shapes)
        self.arrays = {name: np.zeros((num_layers, num_slots, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}

    @property
    def shape(self) -> tuple[int, int]:
        return stacked_shape(self.arrays)

    def write_slot(self, layer: int, slot: int, payload: Mapping[str, np.ndarray]) -> None:
        """Copies one expert into ``[layer, slot]``; :class:`ExpertPayloadError` (slot untouched) if it is not one,
        ValueError if ``[layer, slot]`` is not a slot of the arena."""
        check_slot(self.shape, layer, slot)
        check_payload(payload, self.slot_layout)
        for name, value in payload.items():
            self.arrays[name][layer, slot] = value

    def write_slots(self, layers, slots, payloads: Sequence[Mapping[str, np.ndarray]]) -> list[BaseException | None]:
        """Copies n experts into ``[layers[i], slots[i]]``, every payload checked first (:func:`checked_writes`);
        one error (that expert not written, its slot untouched) or None per write. A slot written twice keeps
        its last write.

        Args:
            layers, slots: int ``[n]``; payloads: n ``{projection: array}``.
        """
        layers, slots, errors = checked_writes(self.shape, layers, slots, payloads, lambda layer: self.slot_layout)
        valid = [j for j, error in enumerate(errors) if error is None]
        if not valid:
            return errors
        at_layers, at_slots = np.array([layers[j] for j in valid]), np.array([slots[j] for j in valid])
        # Small experts are stacked and scattered, one copy per projection; large ones (or a slot written
        # twice, or arrays of several dtypes) are copied one by one, with no stacked copy of them all.
        scattered = (len(valid) > 1 and np.unique(at_layers * self.shape[1] + at_slots).size == len(valid))
        for name, target in self.arrays.items():
            values = [payloads[j][name] for j in valid]
            if (scattered and target[0, 0].nbytes * len(values) <= _STACKED_WRITE_BYTES
                    and all(type(value) is np.ndarray for value in values)
                    and len({value.dtype for value in values}) == 1):
                target[at_layers, at_slots] = np.stack(values)
            else:
                for layer, slot, value in zip(at_layers.tolist(), at_slots.tolist(), values):
                    target[layer, slot] = value
        return errors

    @property
    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (array.shape[2:], array.dtype) for name, array in self.arrays.items()}
