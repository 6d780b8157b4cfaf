"""Reads run and published as batches: what each read's outcome makes of it, however the batch mixes them.

The manager looks at a batch's outcomes once (their types, then arrays), so every test here puts different
outcomes into one batch and checks each read's fate against the rule for one read alone: an int in
``[0, MAX_BYTE_COUNT]`` is the bytes read; None or another integral (a bool) counts ``bytes_per_expert``; an
int out of range fails its read; anything else is a payload for the arena; a raise fails its read.
"""

import threading

import numpy as np
import pytest

from kq import route_shed
from kq_host.arena import NumpyArena
from kq_host.residency import MAX_BYTE_COUNT, LayerReport, ManagerClosed, ResidencyManager

SHAPES = {"gate_proj": ((4, 3), np.float32), "down_proj": ((3, 4), np.float32)}
BYTES_PER_EXPERT = 5
try:
    import numba  # noqa: F401
    IMPLS = ("numpy", "numba")
except ImportError:
    IMPLS = ("numpy",)


def payload(value: float) -> dict:
    return {name: np.full(shape, value, dtype) for name, (shape, dtype) in SHAPES.items()}


def one_token(manager, experts):
    """One step of layer 0 routing ``experts`` (equal scores; misses from ``route_shed``)."""
    ids = np.array([experts], np.int32)
    scores = np.full(ids.shape, 1.0 / ids.size, np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    return manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)])


class Refused(Exception):
    pass


# Each outcome a loader may hand back: (what the loader returns or raises, lands, bytes it counts).
OUTCOMES = {
    "int": (48, True, 48),
    "zero": (0, True, 0),
    "max": (MAX_BYTE_COUNT, True, MAX_BYTE_COUNT),
    "np-int64": (np.int64(7), True, 7),
    "np-uint8": (np.uint8(9), True, 9),
    "none": (None, True, BYTES_PER_EXPERT),
    "bool": (True, True, BYTES_PER_EXPERT),
    "negative": (-1, False, 0),
    "past-max": (MAX_BYTE_COUNT + 1, False, 0),
    "past-int64": (2**70, False, 0),
    "np-uint64-past-int64": (np.uint64(2**64 - 1), False, 0),
    "payload": ("payload", True, BYTES_PER_EXPERT),
    "wrong-payload": ({"gate_proj": np.zeros((1, 1), np.float32)}, False, 0),
    "np-bool": (np.True_, False, 0),  # no integral, so a payload: the arena refuses it
    "raises": (Refused("bad sector"), False, 0),
}


def manager_for(kinds, impl, arena=True):
    """A manager whose loader returns (or raises) ``OUTCOMES[kinds[e]]`` for expert e of layer 0."""

    def loader(layer, expert, slot):
        value = OUTCOMES[kinds[expert]][0]
        if isinstance(value, Exception):
            raise value
        if isinstance(value, str):
            return payload(expert)
        return value

    return ResidencyManager(1, len(kinds), len(kinds), loader=loader, arena=NumpyArena(1, len(kinds), SHAPES)
                            if arena else None, queue_depth=0, bytes_per_expert=BYTES_PER_EXPERT, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", sorted(OUTCOMES))
def test_each_outcome_alone_and_in_a_batch_of_others_has_the_same_fate(kind, impl):
    others = ["int", "none", "payload", "raises", kind, "np-int64", kind]
    for kinds in ([kind] * 3, others, [kind, *others]):
        manager = manager_for(kinds, impl)
        one_token(manager, list(range(len(kinds))))
        manager.drain()
        total = manager.stats()[1]
        lands = [OUTCOMES[k][1] for k in kinds]
        assert sorted(manager.resident(0)) == [e for e, landed in enumerate(lands) if landed], kinds
        assert sorted(key[1] for key in manager.failures) == [e for e, landed in enumerate(lands) if not landed]
        assert total.bytes_read == sum(OUTCOMES[k][2] for k in kinds), kinds
        for expert, slot in manager.resident(0).items():
            if kinds[expert] == "payload":
                assert (manager.arena.arrays["gate_proj"][0, slot] == expert).all()
        for (_, expert), record in manager.failures.items():
            if kinds[expert] in ("negative", "past-max", "past-int64", "np-uint64-past-int64"):
                assert record.error_type == "ValueError" and "as the bytes it read" in record.message
                assert str(OUTCOMES[kinds[expert]][0]) in record.message
        manager.close()


def test_only_ints_one_past_int64_fails_that_read_alone():
    manager = manager_for(["int", "past-int64", "int", "int"], "numpy", arena=False)
    one_token(manager, [0, 1, 2, 3])
    manager.drain()
    assert sorted(manager.resident(0)) == [0, 2, 3] and list(manager.failures) == [(0, 1)]
    assert manager.stats()[1].bytes_read == 3 * 48


def test_a_payload_without_an_arena_fails_beside_reads_that_land():
    manager = manager_for(["int", "payload", "none", "payload"], "numpy", arena=False)
    one_token(manager, [0, 1, 2, 3])
    manager.drain()
    assert sorted(manager.resident(0)) == [0, 2] and sorted(manager.failures) == [(0, 1), (0, 3)]
    assert all("no arena" in record.message for record in manager.failures.values())


@pytest.mark.parametrize("raising", [(0,), (3,), (7,), (2, 3), (0, 7), (0, 1, 2, 3, 4, 5, 6, 7)],
                         ids=lambda r: "-".join(map(str, r)))
def test_inline_reads_go_on_past_a_read_that_raises(raising):
    calls = []

    def loader(layer, expert, slot):
        calls.append(expert)
        if expert in raising:
            raise (KeyboardInterrupt() if expert == 7 else OSError(f"bad sector {expert}"))
        return 10 + expert

    manager = ResidencyManager(1, 8, 8, loader=loader, queue_depth=0, impl="numpy")
    try:
        one_token(manager, list(range(8)))
        manager.drain()
    except KeyboardInterrupt:  # re-raised once its read is published as failed
        assert 7 in raising
    assert sorted(calls) == list(range(8))  # every read ran once
    assert sorted(manager.resident(0)) == [e for e in range(8) if e not in raising]
    assert sorted(e for _, e in manager.failures) == sorted(raising)
    for (_, expert), record in manager.failures.items():
        assert record.error_type == ("KeyboardInterrupt" if expert == 7 else "OSError")
    assert manager.stats()[1].bytes_read == sum(10 + e for e in range(8) if e not in raising)
    assert manager.pending() == []


def test_a_close_while_inline_reads_run_starts_none_after_the_one_running():
    """close on another thread returns (its timeout spent on the busy step) while an inline read runs: that read
    finishes, no later read of the batch starts, and the step raises ManagerClosed."""
    running, release, calls, closes = threading.Event(), threading.Event(), [], []

    def loader(layer, expert, slot):
        calls.append(expert)
        if len(calls) == 2:
            running.set()
            release.wait(10)
        return 1

    manager = ResidencyManager(1, 8, 4, loader=loader, queue_depth=0, impl="numpy")
    raised = []

    def run():
        try:
            one_token(manager, [1, 2, 3, 4])
        except BaseException as error:  # noqa: BLE001 - examined below
            raised.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert running.wait(10)
        closes.append(manager.close(timeout=0.1))
    finally:
        release.set()
        worker.join(10)
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosed), raised
    assert len(calls) == 2


def test_payloads_found_sharing_memory_are_those_every_pair_compared_finds():
    """The manager compares only the arrays that may share memory (backed by one allocation, or by memory another
    object may expose): it refuses the same reads as comparing every pair does, whatever backs the arrays."""
    import mmap

    from kq_host.expert_store import shared_memory_pairs
    from kq_host.residency import _refuse_shared_buffers

    rng = np.random.default_rng(11)
    block = np.zeros((16, 12), np.float32)
    buffer, mapped = bytearray(16 * 48), mmap.mmap(-1, 16 * 48)

    def array(kind):
        row = int(rng.integers(0, 16))
        if kind == 0:
            return np.zeros(12, np.float32)  # memory of its own
        if kind == 1:
            return block[row]  # a row of one block: overlaps another read of the same row
        if kind == 2:
            return block[row, ::-1]  # the same, backwards
        if kind == 3:
            return np.frombuffer(buffer, np.float32, 12, row * 48)  # a bytearray, through a memoryview
        if kind == 4:
            return np.ndarray((12,), np.float32, buffer=mapped, offset=row * 48)  # an mmap
        if kind == 5:
            return np.ndarray((12,), np.float32, buffer=buffer, offset=row * 48)  # the bytearray itself
        if kind == 6:
            return block[row, :0]  # empty
        return block[:, row % 12]  # a column: strided across every row

    for trial in range(300):
        kinds = rng.choice(8, int(rng.integers(1, 4)), replace=False) if trial % 2 else [int(rng.integers(0, 8))]
        count = int(rng.integers(1, 7))
        picked = [{f"p{i}": array(int(rng.choice(kinds))) for i in range(int(rng.integers(1, 3)))}
                  for _ in range(count)]
        picked.append(7)  # a byte count, no payload
        failed = np.zeros(len(picked), bool)
        carried = np.array([isinstance(p, dict) for p in picked])
        owners, arrays = zip(*[(j, value) for j, p in enumerate(picked[:-1]) for value in p.values()])
        want = sorted({owners[i] for pair in shared_memory_pairs(list(arrays)) for i in pair})
        _refuse_shared_buffers(picked, failed, carried)
        assert np.flatnonzero(failed).tolist() == want, (trial, kinds)
        assert all(isinstance(picked[j], ValueError) for j in want)
