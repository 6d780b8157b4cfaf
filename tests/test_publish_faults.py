"""Publishing landed reads when something raises: no slot stranded, no buffer aliased, no hang.

The stateful test drives a manager over random schedules with faults injected into the loader and
the arena, checking after every step that every slot is free, loading or resident for exactly one
expert, that the tables point only at resident slots, and that the reads in flight are the reads out.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kq import route_shed
from kq_host.arena import NumpyArena
from kq_host.residency import MAX_BYTE_COUNT, LayerReport, PreloadError, ResidencyManager

SHAPES = {"gate_proj": ((4, 3), np.float32), "down_proj": ((3, 4), np.float32)}


def payload(value: float) -> dict:
    return {name: np.full(shape, value, dtype) for name, (shape, dtype) in SHAPES.items()}


def reports(manager, rows):
    """One token's reports: ``rows[layer]`` routed ids, equal scores, misses from ``route_shed``."""
    tables = manager.snapshot()
    out = []
    for layer, ids in enumerate(rows):
        ids = np.array(ids, np.int32).reshape(1, -1)
        scores = np.full(ids.shape, 1.0 / ids.shape[1], np.float32)
        shed = route_shed(ids, scores, tables[layer])
        out.append(LayerReport(ids, scores, shed.miss_ids, shed.miss_scores))
    return out


def check_invariants(manager):
    """Every slot free, loading or resident for exactly one expert; tables equal to the owners;
    the reads in flight equal to the reads out."""
    tables = manager.snapshot()
    pending = manager.pending()
    loading = {(r.layer, r.slot): r.expert for r in pending}
    assert len(loading) == len(pending), "two reads into one slot"
    for layer in range(manager.num_layers):
        owner = manager.slot_owner(layer)
        held = owner[owner >= 0]
        assert held.size == np.unique(held).size, f"layer {layer}: an expert owns two slots: {owner}"
        resident = {int(e): int(s) for e, s in enumerate(tables[layer]) if s >= 0}
        for expert, slot in resident.items():
            assert owner[slot] == expert, f"layer {layer}: expert {expert}'s table points at slot {slot} of {owner[slot]}"
            assert (layer, slot) not in loading, f"layer {layer}: slot {slot} resident and loading"
        for slot in np.flatnonzero(owner >= 0).tolist():
            if slot not in resident.values():
                assert loading.get((layer, slot)) == owner[slot], f"layer {layer}: slot {slot} stranded"
    _, total = manager.stats()
    assert total.reads_in_flight == len(pending)
    assert total.reads_submitted == total.reads_landed + total.reads_failed + total.reads_in_flight
    assert total.bytes_read >= 0


class RaisingOnce(NumpyArena):
    """A NumPy arena whose batch write raises on the calls listed (device out of memory, say)."""

    def __init__(self, *args, raise_on=(0,)):
        super().__init__(*args)
        self.calls, self.raise_on = 0, set(raise_on)

    def write_slots(self, layers, slots, payloads):
        self.calls += 1
        if self.calls - 1 in self.raise_on:
            raise MemoryError("out of device memory")
        return [self.write_slot_checked(l, s, p) for l, s, p in zip(layers.tolist(), slots.tolist(), payloads)]

    def write_slot_checked(self, layer, slot, payload):
        try:
            self.write_slot(layer, slot, payload)
        except Exception as error:  # noqa: BLE001
            return error
        return None


def test_an_arena_write_that_raises_fails_its_reads_and_strands_no_slot():
    arena = RaisingOnce(1, 4, SHAPES)
    manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: payload(e), arena=arena, queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1, 2]]))  # reads submitted (inline)
    manager.step(reports(manager, [[1, 2]]))  # publishing them: the arena raises
    check_invariants(manager)
    assert manager.resident(0) == {}
    assert {key: record.error_type for key, record in manager.failures.items()} == {(0, 1): "MemoryError",
                                                                                     (0, 2): "MemoryError"}
    for _ in range(6):  # back-off over, read again, published
        manager.step(reports(manager, [[1, 2]]))
    check_invariants(manager)
    assert sorted(manager.resident(0)) == [1, 2] and not manager.failures
    assert all((arena.arrays["gate_proj"][0, slot] == expert).all() for expert, slot in manager.resident(0).items())


@pytest.mark.parametrize("count, landed", [(2**70, False), (-5, False), (MAX_BYTE_COUNT, True), (np.int64(7), True),
                                           (True, True)], ids=["2**70", "negative", "max", "np-int64", "bool"])
def test_a_byte_count_that_is_no_byte_count_fails_its_read(count, landed):
    manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: count, queue_depth=0, bytes_per_expert=3,
                               impl="numpy")
    manager.step(reports(manager, [[1]]))
    manager.step(reports(manager, [[1]]))
    check_invariants(manager)
    _, total = manager.stats()
    assert (manager.resident(0) == {1: 0}) == landed
    if landed:
        assert total.bytes_read == (3 if isinstance(count, bool) else int(count))
    else:
        assert manager.failures[(0, 1)].error_type == "ValueError" and str(count) in manager.failures[(0, 1)].message
        assert total.bytes_read == 0


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_a_payload_with_no_arena_to_write_it_fails_its_read(impl):
    if impl == "numba":
        pytest.importorskip("numba")
    manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: payload(e), queue_depth=0, impl=impl)
    manager.step(reports(manager, [[1]]))
    manager.drain()
    check_invariants(manager)
    assert manager.resident(0) == {}  # nothing was written: the expert must not be served from the slot
    record = manager.failures[(0, 1)]
    assert record.error_type == "ValueError" and "arena" in record.message
    assert manager.stats()[1].reads_landed == 0


@pytest.mark.parametrize("returns", ["byte count", "None"])
def test_a_loader_that_writes_into_the_arena_itself_is_published_beside_one(returns):
    """NumpyArena may be written by the loader (its slot is never mapped while loading); the manager, given
    that arena for its shape check, writes nothing more for a read that returned no payload."""
    arena = NumpyArena(1, 4, SHAPES)

    def loader(layer, expert, slot):
        for name, value in payload(expert).items():
            arena.arrays[name][layer, slot] = value
        return 48 if returns == "byte count" else None

    manager = ResidencyManager(1, 8, 4, loader=loader, arena=arena, queue_depth=0, bytes_per_expert=5, impl="numpy")
    manager.step(reports(manager, [[1, 2]]))
    manager.drain()
    check_invariants(manager)
    assert sorted(manager.resident(0)) == [1, 2] and not manager.failures
    assert all((arena.arrays["gate_proj"][0, slot] == expert).all() for expert, slot in manager.resident(0).items())
    assert manager.stats()[1].bytes_read == (96 if returns == "byte count" else 10)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def test_an_exception_whose_message_raises_is_recorded():
    def loader(layer, expert, slot):
        raise Unprintable()

    manager = ResidencyManager(1, 8, 4, loader=loader, queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1]]))
    manager.step(reports(manager, [[1]]))
    check_invariants(manager)
    record = manager.failures[(0, 1)]
    assert record.error_type == "Unprintable" and "could not be formed" in record.message


def test_mlx_arrays_from_the_loader_are_checked_not_raised_on():
    mx = pytest.importorskip("mlx.core")
    from kq_mlx.arena import MlxArena

    arena = MlxArena(1, 4, SHAPES)
    loader = lambda l, e, s: {name: mx.full(shape, float(e)) for name, (shape, _) in SHAPES.items()}  # noqa: E731
    manager = ResidencyManager(1, 8, 4, loader=loader, arena=arena, queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1, 2]]))
    manager.step(reports(manager, [[1, 2]]))
    check_invariants(manager)
    assert sorted(manager.resident(0)) == [1, 2] and not manager.failures
    slot = manager.resident(0)[2]
    assert np.array(arena.arrays["gate_proj"][0, slot]).tolist() == np.full((4, 3), 2.0).tolist()


def test_one_staging_buffer_per_shape_is_refused_not_aliased():
    staging = {}

    def loader(layer, expert, slot):  # the pinned-memory pattern: one buffer per shape, reused
        out = {}
        for name, (shape, dtype) in SHAPES.items():
            buffer = staging.setdefault(shape, np.empty(shape, dtype))
            buffer[...] = expert
            out[name] = buffer
        return out

    arena = NumpyArena(1, 4, SHAPES)
    manager = ResidencyManager(1, 8, 4, loader=loader, arena=arena, queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1, 2, 3]]))
    manager.step(reports(manager, [[1, 2, 3]]))
    check_invariants(manager)
    assert manager.resident(0) == {}
    assert {record.error_type for record in manager.failures.values()} == {"ValueError"}
    assert "share memory" in manager.failures[(0, 1)].message


def test_a_payload_dict_reused_across_reads_is_refused():
    shared = payload(0.0)

    def loader(layer, expert, slot):
        for array in shared.values():
            array[...] = expert
        return shared

    manager = ResidencyManager(1, 8, 4, loader=loader, arena=NumpyArena(1, 4, SHAPES), queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1, 2]]))
    manager.step(reports(manager, [[1, 2]]))
    check_invariants(manager)
    assert manager.resident(0) == {} and len(manager.failures) == 2


def test_disjoint_views_of_one_buffer_are_not_aliasing():
    block = np.zeros((8, 2, 12), np.float32)  # one read buffer, each expert in its own row

    def loader(layer, expert, slot):
        block[expert] = expert
        return {"gate_proj": block[expert, 0].reshape(4, 3), "down_proj": block[expert, 1].reshape(3, 4)}

    arena = NumpyArena(1, 4, SHAPES)
    manager = ResidencyManager(1, 8, 4, loader=loader, arena=arena, queue_depth=0, impl="numpy")
    manager.step(reports(manager, [[1, 2, 3]]))
    manager.step(reports(manager, [[1, 2, 3]]))
    check_invariants(manager)
    assert sorted(manager.resident(0)) == [1, 2, 3] and not manager.failures

def _arena(kind: str, shapes):
    if kind == "numpy":
        return NumpyArena(2, 3, shapes)
    if kind == "jax":
        pytest.importorskip("jax")
        from kq_jax.arena import JaxArena

        return JaxArena(2, 3, shapes)
    pytest.importorskip("mlx.core")
    from kq_mlx.arena import MlxArena

    return MlxArena(2, 3, shapes)


@pytest.mark.parametrize("kind, batch", [("numpy", False), ("jax", False), ("jax", True), ("mlx", False),
                                         ("mlx", True)], ids=lambda x: {False: "write_slot", True: "write_slots"}.get(x, x))
def test_an_arena_keeps_what_was_written_when_the_buffer_is_reused_at_once(kind, batch):
    """A write has taken the payload's bytes when it returns: the staging buffer may be filled with the
    next expert at once (what a host allocator that recycles its buffers does), never changing the slot."""
    shapes = {"gate_proj": ((256, 256), np.float32), "down_proj": ((256, 128), np.float32)}
    arena = _arena(kind, shapes)
    staging = {name: np.empty(shape, dtype) for name, (shape, dtype) in shapes.items()}
    rng = np.random.default_rng(5)
    written = {}
    for trial in range(24):
        layer, slot = trial % 2, trial % 3
        for buffer in staging.values():
            buffer[...] = rng.standard_normal(buffer.shape, np.float32)
        written[layer, slot] = {name: buffer.copy() for name, buffer in staging.items()}
        if batch:
            assert arena.write_slots(np.array([layer]), np.array([slot]), [staging]) == [None]
        else:
            arena.write_slot(layer, slot, staging)
        for buffer in staging.values():  # the next read lands in the same buffers
            buffer[...] = np.float32(np.nan)
    for (layer, slot), want in written.items():
        for name, value in want.items():
            got = np.asarray(arena.arrays[name][layer, slot])
            assert got.tobytes() == value.tobytes(), f"{kind}: slot ({layer}, {slot}) {name} changed after the write"



@pytest.mark.parametrize("queue_depth", [0, 2])
def test_step_and_preload_after_close_are_refused_before_touching_state(queue_depth):
    manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: 1, queue_depth=queue_depth, impl="numpy")
    manager.step(reports(manager, [[1]]))
    manager.close()
    before = (manager.snapshot(), manager.slot_owner(0), manager.stats()[1])
    with pytest.raises(RuntimeError, match="ResidencyManager.step: the manager was closed"):
        manager.step(reports(manager, [[2, 3]]))
    with pytest.raises(RuntimeError, match="ResidencyManager.preload: the manager was closed"):
        manager.preload(0, [4])
    after = (manager.snapshot(), manager.slot_owner(0), manager.stats()[1])
    assert (before[0] == after[0]).all() and (before[1] == after[1]).all() and before[2] == after[2]


def test_a_stuck_loader_does_not_keep_the_process_from_exiting():
    script = textwrap.dedent("""
        import threading
        from kq_host.residency import ResidencyManager
        never = threading.Event()
        manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: never.wait(), queue_depth=2, impl="numpy")
        try:
            manager.preload(0, [1, 2], timeout=0.2)
        except Exception as error:
            print(type(error).__name__, len(error.pending))
        print("closed with", len(manager.close(timeout=0.1)), "out")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["PreloadError 2", "closed with 2 out"]


def test_preload_raises_naming_the_reads_that_failed():
    def loader(layer, expert, slot):
        if expert == 3:
            raise OSError("bad sector")
        return 1

    manager = ResidencyManager(1, 8, 4, loader=loader, queue_depth=0, impl="numpy")
    with pytest.raises(PreloadError, match="expert 3: OSError: bad sector") as raised:
        manager.preload(0, [1, 3, 5])
    assert [record.expert for record in raised.value.failed] == [3] and raised.value.pending == []
    assert sorted(manager.resident(0)) == [1, 5]
    check_invariants(manager)


# ---- the stateful fault test ------------------------------------------------------------------

LAYERS, EXPERTS, SLOTS = 2, 6, 3
LOADER_FAULTS = ("ok", "raise", "interrupt", "unprintable", "huge-count", "negative-count", "wrong-payload",
                 "reused-buffer")
ARENA_FAULTS = ("ok", "write-raises", "batch-raises", "short-answer")
try:
    import numba  # noqa: F401
    IMPLS = ("numpy", "numba")
except ImportError:
    IMPLS = ("numpy",)


class FaultyArena(NumpyArena):
    def __init__(self):
        super().__init__(LAYERS, SLOTS, SHAPES)
        self.fault = "ok"

    def write_slots(self, layers, slots, payloads):
        if self.fault == "batch-raises":
            raise MemoryError("out of device memory")
        if self.fault == "short-answer":
            return []
        out = []
        for layer, slot, item in zip(layers.tolist(), slots.tolist(), payloads):
            try:
                if self.fault == "write-raises" and slot % 2:
                    raise RuntimeError("write failed")
                self.write_slot(layer, slot, item)
                out.append(None)
            except Exception as error:  # noqa: BLE001
                out.append(error)
        return out


class PublishingUnderFaults(RuleBasedStateMachine):
    @initialize(queue_depth=st.sampled_from([0, 2]), policy=st.sampled_from(["lfu", "lru"]),
                budget=st.sampled_from([None, 1, 3]), impl=st.sampled_from(IMPLS))
    def start(self, queue_depth, policy, budget, impl):
        self.arena = FaultyArena()
        self.faults = {}
        self.buffer = payload(0.0)
        self.manager = ResidencyManager(LAYERS, EXPERTS, SLOTS, loader=self.load, arena=self.arena,
                                        queue_depth=queue_depth, policy=policy, read_budget=budget, impl=impl)

    def load(self, layer, expert, slot):
        fault = self.faults.get((layer, expert), "ok")
        if fault == "raise":
            raise OSError("bad sector")
        if fault == "interrupt":
            raise KeyboardInterrupt()
        if fault == "unprintable":
            raise Unprintable()
        if fault == "huge-count":
            return 2**70
        if fault == "negative-count":
            return -1
        if fault == "wrong-payload":
            return {"gate_proj": np.zeros((1, 1), np.float32)}
        if fault == "reused-buffer":  # refused when another unpublished payload shares it
            for array in self.buffer.values():
                array[...] = expert
            return self.buffer
        return payload(expert)

    @rule(layer=st.integers(0, LAYERS - 1), expert=st.integers(0, EXPERTS - 1), fault=st.sampled_from(LOADER_FAULTS))
    def set_loader_fault(self, layer, expert, fault):
        self.faults[(layer, expert)] = fault

    @rule(fault=st.sampled_from(ARENA_FAULTS))
    def set_arena_fault(self, fault):
        self.arena.fault = fault

    @rule(rows=st.integers(1, 3).flatmap(lambda k: st.lists(
        st.lists(st.integers(0, EXPERTS - 1), min_size=k, max_size=k), min_size=LAYERS, max_size=LAYERS)))
    def step(self, rows):
        try:
            self.manager.step(reports(self.manager, rows))
        except KeyboardInterrupt:
            pass  # re-raised after the bookkeeping, as a loader's interrupt should be
        try:
            self.manager.drain(timeout=5.0)
        except KeyboardInterrupt:
            pass

    @invariant()
    def consistent(self):
        if hasattr(self, "manager"):
            check_invariants(self.manager)
            for layer in range(LAYERS):  # a resident slot holds its expert's weights
                for expert, slot in self.manager.resident(layer).items():
                    assert (self.arena.arrays["gate_proj"][layer, slot] == expert).all()

    def teardown(self):
        if hasattr(self, "manager"):
            self.manager.close(timeout=5.0)


TestPublishingUnderFaults = PublishingUnderFaults.TestCase
TestPublishingUnderFaults.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("field, value", [("indices", np.array([[1.7]], np.float32)),
                                          ("indices", np.array([["1"]])),
                                          ("miss_ids", np.array([[np.nan]])),
                                          ("scores", np.array([["0.5"]]))],
                         ids=["float-ids", "string-ids", "nan-miss-id", "string-scores"])
def test_reports_of_the_wrong_kind_are_refused_not_converted(field, value):
    manager = ResidencyManager(1, 8, 4, loader=lambda l, e, s: 1, queue_depth=0, impl="numpy")
    good = dict(indices=np.array([[1]], np.int32), scores=np.array([[1.0]], np.float32),
                miss_ids=np.array([[1]], np.int32), miss_scores=np.array([[1.0]], np.float32))
    good[field] = value
    with pytest.raises(ValueError, match=f"step: {field} must be"):
        manager.step([LayerReport(**good)])
    assert manager.stats()[1].lookups == 0 and manager.pending() == []
