"""A batch of arena writes decides as its writes one by one: ``checked_writes`` (one check per kind of payload
in a batch) and ``NumpyArena.write_slots`` (small experts stacked and scattered) against ``check_slot`` +
``check_payload`` and ``write_slot`` on each, over random batches mixing good and bad payloads."""

from collections import OrderedDict

import numpy as np
import pytest

from kq_host.arena import NumpyArena, check_payload, check_slot, checked_writes

SHAPES = {"gate_proj": ((4, 3), np.float32), "down_proj": ((3, 4), np.float32)}
LAYERS, SLOTS = 3, 4


def menu(rng, value):
    """One payload of a random kind, good or bad, filled with ``value``."""
    good = {name: np.full(shape, value, dtype) for name, (shape, dtype) in SHAPES.items()}
    kind = rng.integers(0, 11)
    if kind == 0:
        return {**good, "gate_proj": good["gate_proj"].astype(np.float16)}  # casts safely: written
    if kind == 1:
        return {**good, "gate_proj": good["gate_proj"].astype(np.float64)}  # does not
    if kind == 2:
        return {**good, "down_proj": good["down_proj"].reshape(4, 3)}  # wrong shape
    if kind == 3:
        return {"gate_proj": good["gate_proj"]}  # missing
    if kind == 4:
        return {**good, "up_proj": good["gate_proj"]}  # unexpected
    if kind == 5:
        return OrderedDict(good)  # another mapping
    if kind == 6:
        return [good]  # no mapping
    if kind == 7:
        return {**good, "gate_proj": good["gate_proj"].tolist()}  # a list: no dtype
    if kind == 8:
        return {**good, "gate_proj": np.asfortranarray(good["gate_proj"])}  # another layout, same values
    return good


def errors_alone(shape, layers, slots, payloads, layout):
    out = []
    for layer, slot, payload in zip(layers, slots, payloads):
        try:
            check_slot(shape, layer, slot)
            check_payload(payload, layout)
            out.append(None)
        except ValueError as error:
            out.append(error)
    return out


def same_errors(got, want):
    assert [type(e) for e in got] == [type(e) for e in want]
    assert [str(e) for e in got] == [str(e) for e in want]


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_checks_and_writes_as_its_writes_one_by_one(seed):
    rng = np.random.default_rng(seed)
    for trial in range(30):
        count = int(rng.integers(0, 12))
        layers = rng.integers(-1, LAYERS + 1, count)  # a few outside the arena
        slots = rng.integers(-1, SLOTS + 1, count)  # and repeats: a slot written twice keeps its last write
        payloads = [menu(rng, float(seed * 1000 + trial * 20 + j)) for j in range(count)]
        batched, alone = NumpyArena(LAYERS, SLOTS, SHAPES), NumpyArena(LAYERS, SLOTS, SHAPES)
        want = errors_alone(batched.shape, layers.tolist(), slots.tolist(), payloads, batched.slot_layout)
        layout = batched.slot_layout
        _, _, checked = checked_writes(batched.shape, layers, slots, payloads, lambda layer, layout=layout: layout)
        same_errors(checked, want)
        same_errors(batched.write_slots(layers, slots, payloads), want)
        for layer, slot, payload, error in zip(layers.tolist(), slots.tolist(), payloads, want):
            if error is None:
                alone.write_slot(layer, slot, payload)
        for name in SHAPES:
            assert batched.arrays[name].tobytes() == alone.arrays[name].tobytes(), (trial, name)


def test_large_experts_are_written_one_by_one_with_the_same_result(monkeypatch):
    from kq_host import arena as arena_module

    monkeypatch.setattr(arena_module, "_STACKED_WRITE_BYTES", 0)
    rng = np.random.default_rng(9)
    payloads = [menu(rng, float(j)) for j in range(10)]
    layers, slots = np.arange(10) % LAYERS, np.arange(10) % SLOTS
    batched, alone = NumpyArena(LAYERS, SLOTS, SHAPES), NumpyArena(LAYERS, SLOTS, SHAPES)
    errors = batched.write_slots(layers, slots, payloads)
    for layer, slot, payload, error in zip(layers.tolist(), slots.tolist(), payloads, errors):
        if error is None:
            alone.write_slot(layer, slot, payload)
    assert all(batched.arrays[name].tobytes() == alone.arrays[name].tobytes() for name in SHAPES)


def test_a_batch_of_writes_that_are_no_arrays_of_indices_is_refused_by_name():
    arena = NumpyArena(LAYERS, SLOTS, SHAPES)
    good = {name: np.zeros(shape, dtype) for name, (shape, dtype) in SHAPES.items()}
    with pytest.raises(ValueError, match="write_slots: layers and slots must be 1-D integer arrays"):
        arena.write_slots(np.array([0.0]), np.array([1]), [good])
    with pytest.raises(ValueError, match="write_slots: layers and slots must be 1-D integer arrays"):
        arena.write_slots(np.array([0, 1]), np.array([1]), [good])
    assert not any(array.any() for array in arena.arrays.values())
