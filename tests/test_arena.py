"""The host side of the arena: prestage order, residency manager, expert store, adapters."""

import threading

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kq import route_shed
from kq_host.arena import NumpyArena
from kq_host.expert_store import ExpertStore, ExpertStoreError
from kq_host.prestage import prestage_order
from kq_host.residency import LayerReport, ResidencyManager

# ---- prestage_order ---------------------------------------------------------------------


def prestage_brute_force(miss_ids, miss_scores):
    best, count = {}, {}
    for e, s in zip(np.ravel(miss_ids).tolist(), np.ravel(miss_scores).astype(np.float32).tolist()):
        if e < 0:
            continue
        count[e] = count.get(e, 0) + 1
        if s == s and (e not in best or best[e] != best[e] or s > best[e]):
            best[e] = s
        best.setdefault(e, float("nan"))
    rank = sorted(best, key=lambda e: (best[e] != best[e], -best[e] if best[e] == best[e] else 0, e))
    return rank, [count[e] for e in rank], [best[e] for e in rank]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 6), k=st.integers(1, 8), experts=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_prestage_order_matches_brute_force(rows, k, experts, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, experts, (rows, k))
    scores = rng.choice(np.array([0.5, 0.25, 0.125, np.nan, -np.inf, 0.0], np.float32), (rows, k))
    got = prestage_order(ids, scores, experts)
    want_ids, want_counts, want_best = prestage_brute_force(ids, scores)
    assert got.expert_ids.tolist() == want_ids
    assert got.counts.tolist() == want_counts
    np.testing.assert_array_equal(got.best_scores, np.array(want_best, np.float32))


def test_prestage_order_of_route_shed_output():
    table = np.array([0, -1, 1, -1, -1], np.int32)
    out = route_shed(np.array([[0, 1, 3], [3, 4, 2]], np.int32),
                     np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], np.float32), table)
    order = prestage_order(out.miss_ids, out.miss_scores, 5)
    assert order.expert_ids.tolist() == [3, 1, 4] and order.counts.tolist() == [2, 1, 1]


def test_prestage_order_rejects_ids_outside_the_table():
    with pytest.raises(ValueError, match="outside"):
        prestage_order(np.array([[7]]), np.array([[0.5]], np.float32), 4)


# ---- residency manager: policies on hand-worked traces ------------------------------------


def report(ids, scores=None, table=None):
    """A LayerReport for one token, misses computed by route_shed against ``table``."""
    ids = np.array(ids, np.int32).reshape(1, -1)
    scores = np.full(ids.shape, 1.0 / ids.shape[1], np.float32) if scores is None else np.array(
        scores, np.float32).reshape(1, -1)
    out = route_shed(ids, scores, table)
    return LayerReport(ids, scores, out.miss_ids, out.miss_scores)


def run_trace(manager, tokens):
    tables = manager.snapshot()
    for ids in tokens:
        tables = manager.step([report(ids, table=tables[0])])
    return tables


def loaded_into(slots_log):
    def loader(layer, expert, slot):
        slots_log.append((expert, slot))
        return 0

    return loader


def test_lru_trace():
    log = []
    manager = ResidencyManager(1, 6, 2, loader=loaded_into(log), policy="lru", queue_depth=0)
    # t0 routes 0,1 (both miss: loads into slots 0 and 1); they publish at t1's boundary.
    tables = run_trace(manager, [[0, 1], [0, 3], [2, 0]])
    assert log[:2] == [(0, 0), (1, 1)]
    # t1's miss 3 had to evict: 0 and 3 are shielded (routed), 1 is the victim.
    assert log[2] == (3, 1)
    # t2 routes 2 and 0: 3 (published at t2's boundary) is the only victim not shielded,
    # so the next token sees only expert 0 while 2 loads into slot 1.
    assert log[3] == (2, 1)
    assert tables[0].tolist() == [0, -1, -1, -1, -1, -1]
    manager.drain()
    assert manager.resident(0) == {0: 0, 2: 1}


def test_lfu_trace_with_decay():
    log = []
    manager = ResidencyManager(1, 6, 2, loader=loaded_into(log), policy="lfu", decay_interval=0, queue_depth=0)
    run_trace(manager, [[0, 1], [0, 1], [0, 2], [4, 5]])
    # Popularity after t3: 0 -> 3, 1 -> 2, 2 -> 1. t2's miss 2 evicts the less popular of {1} (0 is routed).
    assert log[2] == (2, 1)
    # t3 misses 4 (0.5) and 5 (0.5): the victims are the least popular first: 2 (1) then 0 (3).
    assert log[3:] == [(4, 1), (5, 0)]


def test_pinned_experts_are_never_evicted_and_routed_ones_are_shielded():
    log = []
    manager = ResidencyManager(1, 8, 2, loader=loaded_into(log), pinned={0: [7]}, queue_depth=0)
    manager.preload(0, [7])
    assert manager.resident(0) == {7: 0}
    run_trace(manager, [[1, 2], [3, 4], [5, 6]])
    manager.drain()
    assert manager.resident(0)[7] == 0
    assert all(expert != 7 for expert, _ in log[1:])
    with pytest.raises(ValueError, match="pins"):
        ResidencyManager(1, 8, 1, loader=loaded_into([]), pinned={0: [1, 2]})


def test_read_budget_limits_reads_per_token():
    log = []
    manager = ResidencyManager(2, 16, 8, loader=loaded_into(log), read_budget=3, queue_depth=0)
    tables = manager.snapshot()
    manager.step([report([0, 1, 2, 3], table=tables[0]), report([4, 5, 6, 7], table=tables[1])])
    assert len(log) == 3


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_integer_options_given_as_0d_arrays_are_kept_as_ints(impl):
    if impl == "numba":
        pytest.importorskip("numba")
    log = []

    def loader(layer, expert, slot):  # no byte count: bytes_per_expert counts
        log.append((expert, slot))

    manager = ResidencyManager(np.array(2), np.array(16), np.array(8), loader=loader, read_budget=np.array(3),
                               queue_depth=np.array(0), decay_interval=np.array(4), bytes_per_expert=np.array(5),
                               impl=impl)
    assert all(type(getattr(manager, name)) is int for name in ("num_layers", "num_experts", "num_slots", "read_budget"))
    tables = manager.snapshot()
    manager.step([report([0, 1, 2, 3], table=tables[0]), report([4, 5, 6, 7], table=tables[1])])
    manager.drain()
    assert len(log) == 3 and manager.stats()[1].bytes_read == 15
    manager.close()


def test_failed_read_leaves_the_expert_unpublished_and_is_reported():
    def loader(layer, expert, slot):
        if expert == 2:
            raise OSError("disk on fire")
        return 0

    manager = ResidencyManager(1, 4, 4, loader=loader, queue_depth=0)
    tables = manager.step([report([1, 2], table=manager.snapshot()[0])])
    tables = manager.step([report([1, 3], table=tables[0])])
    assert tables[0, 2] == -1 and tables[0, 1] >= 0
    assert [(f.expert, f.message, f.count) for f in manager.failures.values()] == [(2, "disk on fire", 1)]
    per_layer, total = manager.stats()
    assert total.reads_failed == 1 and total.reads_landed == 1
    assert (manager.slot_owner(0) == 2).sum() == 0  # its slot was freed


def test_statistics_and_over_budget_ledger():
    manager = ResidencyManager(1, 4, 4, loader=loaded_into([]), keep_mass=0.8, queue_depth=0)
    manager.preload(0, [0, 1])
    tables = manager.snapshot()
    # Token 0: ids 0,1 resident, 2 not: shed mass 0.3 of 1.0 > 0.2 -> over budget.
    tables = manager.step([report([0, 1, 2], [0.4, 0.3, 0.3], tables[0])])
    # Token 1: ids 0,1 resident, 7 out of range (shed, not a miss): shed mass 0.1 <= 0.2.
    manager.step([report([0, 1, 7], [0.6, 0.3, 0.1], tables[0])])
    _, total = manager.stats()
    assert (total.lookups, total.hits, total.misses, total.shed_count) == (5, 4, 1, 2)
    assert total.shed_mass == pytest.approx(0.4) and total.routed_mass == pytest.approx(2.0)
    assert total.over_budget == 1
    assert total.hit_rate == pytest.approx(0.8)


# ---- the fence: no snapshot maps a slot whose contents are being replaced --------------------


def expert_content(layer, expert):
    return np.full(64, layer * 1000 + expert, np.float32)


class GatherPasses:
    """Counts the test's gather passes; a loader half way through its write waits for the next one, so every
    read is seen half written by at least one pass."""

    def __init__(self):
        self.condition = threading.Condition()
        self.count = 0
        self.half_written = 0
        self.finished = False

    def wait_for_next(self, after: int) -> None:
        with self.condition:
            self.half_written += 1
            self.condition.notify_all()
            assert self.condition.wait_for(lambda: self.count > after or self.finished, 10), "no gather pass came"

    def wait_until_half_written(self, reads: int) -> None:
        with self.condition:
            assert self.condition.wait_for(lambda: self.half_written >= reads, 10), "a read never started"

    def passed(self, finished: bool = False) -> None:
        with self.condition:
            self.count += 1
            self.finished = finished
            self.condition.notify_all()


def test_fence_under_slow_concurrent_reads():
    """Each read writes half its slot, then waits for the next gather pass before writing the rest: the
    passes always run while slots are half written, and must never see one through the tables."""
    layers, experts, slots = 2, 24, 6
    arena = NumpyArena(layers, slots, {"w": ((64,), np.float32)})
    writing = set()
    lock = threading.Lock()
    passes = GatherPasses()

    def slow_loader(layer, expert, slot):
        with lock:
            writing.add((layer, slot))
            seen = passes.count
        target = arena.arrays["w"][layer, slot]
        target[:32] = expert_content(layer, expert)[:32]  # half written...
        passes.wait_for_next(seen)
        target[32:] = expert_content(layer, expert)[32:]  # ...then the rest
        with lock:
            writing.discard((layer, slot))
        return 256

    rng = np.random.default_rng(0)
    manager = ResidencyManager(layers, experts, slots, loader=slow_loader, queue_depth=4, read_budget=4)
    tables = manager.snapshot()
    checked = passes_beside_a_write = 0
    for token in range(150):
        hot = rng.choice(experts, 4, replace=False) if token % 20 < 10 else rng.choice(8, 4, replace=False)
        passes.wait_until_half_written(manager.stats()[1].reads_submitted)
        # "The gathers" of this token read every mapped slot while loads are half written.
        for _ in range(3):
            with lock:
                passes_beside_a_write += bool(writing)
            for layer in range(layers):
                for expert in np.flatnonzero(tables[layer] >= 0):
                    slot = tables[layer, expert]
                    with lock:
                        assert (layer, slot) not in writing, "a mapped slot is being written"
                    np.testing.assert_array_equal(arena.arrays["w"][layer, slot], expert_content(layer, expert))
                    checked += 1
            passes.passed()
        reports = [report(hot, table=tables[layer]) for layer in range(layers)]
        tables = manager.step(reports, fence=lambda: None)
    passes.passed(finished=True)
    assert manager.drain(timeout=30) == []
    manager.close()
    _, total = manager.stats()
    assert not manager.failures
    assert checked > 1000 and total.evictions > 20 and total.reads_landed > 20 and passes_beside_a_write > 20


# ---- expert store ----------------------------------------------------------------------------

save_file = pytest.importorskip("safetensors.numpy").save_file
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SHAPES = {"gate_proj": (6, 4), "up_proj": (6, 4), "down_proj": (4, 6)}


def weights(layer, expert, projection, dtype):
    base = (layer * 100 + expert) * 10 + PROJECTIONS.index(projection)
    return (np.arange(np.prod(SHAPES[projection])) + base).reshape(SHAPES[projection]).astype(dtype)


@pytest.fixture(params=[np.float32, ml_dtypes.bfloat16, np.float16, np.int8], ids=lambda d: np.dtype(d).name)
def dtype(request):
    return request.param


def write_per_expert(directory, layers, experts, dtype):
    tensors = {f"model.layers.{l}.mlp.experts.{e}.{p}.weight": weights(l, e, p, dtype)
               for l in range(layers) for e in range(experts) for p in PROJECTIONS}
    names = sorted(tensors)
    half = len(names) // 2  # two shards, as checkpoints on the Hub are
    save_file({n: tensors[n] for n in names[:half]}, str(directory / "model-00001.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(directory / "model-00002.safetensors"))


def write_stacked(directory, layers, experts, dtype):
    save_file({f"model.layers.{l}.mlp.experts.{p}": np.stack([weights(l, e, p, dtype) for e in range(experts)])
               for l in range(layers) for p in PROJECTIONS}, str(directory / "experts.safetensors"))


@pytest.mark.parametrize("layout, writer", [("per_expert", write_per_expert), ("stacked", write_stacked)])
def test_store_reads_one_expert(tmp_path, dtype, layout, writer):
    writer(tmp_path, 2, 5, dtype)
    with ExpertStore(tmp_path, layout=layout, projections=PROJECTIONS) as store:
        got = store.read_expert(1, 3)
        for p in PROJECTIONS:
            assert got[p].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[p], weights(1, 3, p, dtype))
        one_expert = sum(weights(0, 0, p, dtype).nbytes for p in PROJECTIONS)
        assert store.bytes_read == one_expert == store.expert_nbytes(1)
        assert store.expert_shapes(0)["down_proj"] == ((4, 6), np.dtype(dtype))


@pytest.mark.parametrize("layout, writer", [("per_expert", write_per_expert), ("stacked", write_stacked)])
def test_store_reads_into_the_host_allocators_buffers(tmp_path, dtype, layout, writer):
    """With ``host_allocator`` each projection lands in the buffer it returned (as page-locked memory
    would be handed in), with the bits of a plain read; the buffers are the arrays returned."""
    writer(tmp_path, 2, 5, dtype)
    handed_out = []

    def allocate(shape, dtype):
        handed_out.append(np.full(shape, 7, dtype))  # not zeros: every byte must be overwritten
        return handed_out[-1]

    with ExpertStore(tmp_path, layout=layout, projections=PROJECTIONS) as plain, \
            ExpertStore(tmp_path, layout=layout, projections=PROJECTIONS, host_allocator=allocate) as store:
        got = store.read_expert(1, 3)
        want = plain.read_expert(1, 3)
        assert len(handed_out) == 3 and all(got[p] is buffer for p, buffer in zip(PROJECTIONS, handed_out))
        for p in PROJECTIONS:
            assert got[p].dtype == want[p].dtype and got[p].shape == want[p].shape
            assert got[p].tobytes() == want[p].tobytes()
        assert store.bytes_read == plain.bytes_read == store.expert_nbytes(1)


@pytest.mark.parametrize("allocate, why", [
    (lambda shape, dtype: np.empty(shape[::-1] + (2,), dtype), "shape"),
    (lambda shape, dtype: np.empty(shape, np.float64), "float64"),
    (lambda shape, dtype: np.empty(shape, dtype).T, "c_contiguous=False"),
    (lambda shape, dtype: np.broadcast_to(np.zeros(1, dtype), shape), "writeable=False"),
    (lambda shape, dtype: bytearray(64), "bytearray"),
])
def test_store_refuses_a_host_buffer_that_is_not_the_read(tmp_path, allocate, why):
    write_stacked(tmp_path, 1, 2, np.float32)
    with ExpertStore(tmp_path, layout="stacked", host_allocator=allocate) as store:
        with pytest.raises(ExpertStoreError, match=f"host_allocator.*{why}"):
            store.read_expert(0, 1)
    with pytest.raises(ValueError, match="host_allocator must be a callable"):
        ExpertStore(tmp_path, layout="stacked", host_allocator=np.zeros((2, 2)))


def test_store_refuses_a_host_allocator_handing_one_buffer_to_two_projections(tmp_path):
    """gate_proj and up_proj share a shape: an allocator keeping one buffer per shape would return the same
    memory for both, and the expert would come back with up_proj's bits under gate_proj."""
    write_stacked(tmp_path, 1, 2, np.float32)
    staging = {}

    def one_buffer_per_shape(shape, dtype):
        return staging.setdefault((tuple(shape), np.dtype(dtype)), np.empty(shape, dtype))

    with ExpertStore(tmp_path, layout="stacked", host_allocator=one_buffer_per_shape) as store:
        with pytest.raises(ExpertStoreError, match="host_allocator.*up_proj.*gate_proj"):
            store.read_expert(0, 1)
        assert store.bytes_read == 0


def test_store_reads_through_disjoint_views_of_one_block(tmp_path):
    """Buffers cut from one block without overlap are each the read's own."""
    write_stacked(tmp_path, 1, 2, np.float32)
    block = np.full(sum(int(np.prod(shape)) for shape in SHAPES.values()), 7, np.float32)
    cuts = iter(np.cumsum([0] + [int(np.prod(SHAPES[p])) for p in PROJECTIONS]).tolist())
    start = next(cuts)

    def from_block(shape, dtype):
        nonlocal start
        end = next(cuts)
        view, start = block[start:end].reshape(shape), end
        return view

    with ExpertStore(tmp_path, layout="stacked", host_allocator=from_block) as store:
        got = store.read_expert(0, 1)
    for p in PROJECTIONS:
        assert got[p].view(np.uint32).tolist() == weights(0, 1, p, np.float32).view(np.uint32).tolist()


def _descriptors_to(path) -> int | None:
    """How many of this process's descriptors are open on ``path`` (Linux), or None where /proc is missing."""
    import os

    try:
        links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    return sum(link == str(path) for link in links)


def test_store_after_close_refuses_reads_and_submissions_by_name(tmp_path):
    from kq_host.expert_store import ExpertStoreClosed

    write_stacked(tmp_path, 1, 2, np.float32)
    path = (tmp_path / "experts.safetensors").resolve()
    store = ExpertStore(tmp_path, layout="stacked")
    assert store.read_expert(0, 0)["up_proj"].view(np.uint32).tolist() == \
        weights(0, 0, "up_proj", np.float32).view(np.uint32).tolist()
    store.close()
    assert _descriptors_to(path) in (0, None)
    with pytest.raises(ExpertStoreClosed, match="ExpertStore.read_expert: the store was closed"):
        store.read_expert(0, 1)
    assert _descriptors_to(path) in (0, None)  # nothing reopened
    with pytest.raises(ExpertStoreClosed, match="ExpertStore.submit: the store was closed"):
        store.submit(0, 1)
    assert isinstance(ExpertStoreClosed("x"), RuntimeError)
    store.close()  # a second close is harmless


def test_store_close_lets_a_read_running_on_another_thread_end_then_closes_its_file(tmp_path):
    """close while a read waits between its projections (in a slow host_allocator): the read ends with the
    expert's bits, and the file closes when it does."""
    write_stacked(tmp_path, 1, 2, np.float32)
    path = (tmp_path / "experts.safetensors").resolve()
    between, release, outcome, calls = threading.Event(), threading.Event(), [], []

    def slow_after_the_first(shape, dtype):
        calls.append(shape)
        if len(calls) == 2:  # the second projection's buffer: the first projection is read
            between.set()
            release.wait(10)
        return np.full(shape, 7, dtype)

    store = ExpertStore(tmp_path, layout="stacked", host_allocator=slow_after_the_first)

    def read():
        try:
            outcome.append(store.read_expert(0, 1))
        except BaseException as error:  # noqa: BLE001 - examined below
            outcome.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert between.wait(10), "the read never reached its second projection"
        store.close()
        assert _descriptors_to(path) in (1, None)  # the running read's file stays open
    finally:
        release.set()
        reader.join(10)
    got = outcome[-1]
    assert isinstance(got, dict), got
    for p in PROJECTIONS:
        assert got[p].view(np.uint32).tolist() == weights(0, 1, p, np.float32).view(np.uint32).tolist()
    assert _descriptors_to(path) in (0, None)  # closed once the read ended


def test_store_refuses_a_layer_or_expert_that_is_no_int_by_name(tmp_path):
    write_stacked(tmp_path, 1, 2, np.float32)
    with ExpertStore(tmp_path, layout="stacked") as store:
        for layer, expert, name in ((0, 1.0, "expert"), (0, True, "expert"), (0, "1", "expert"), (0, -1, "expert"),
                                    (0.0, 1, "layer"), (None, 1, "layer"), (-1, 1, "layer")):
            with pytest.raises(ValueError, match=rf"ExpertStore.read_expert: {name} must be an int >= 0, got"):
                store.read_expert(layer, expert)
            with pytest.raises(ValueError, match=rf"ExpertStore.submit: {name} must be an int >= 0, got"):
                store.submit(layer, expert)
        got = store.read_expert(np.int64(0), np.uint8(1))
        assert got["up_proj"].view(np.uint32).tolist() == weights(0, 1, "up_proj", np.float32).view(np.uint32).tolist()


def test_store_concurrent_reads(tmp_path):
    write_stacked(tmp_path, 3, 16, np.float32)
    with ExpertStore(tmp_path, layout="stacked", queue_depth=8) as store:
        futures = {(l, e): store.submit(l, e) for l in range(3) for e in range(16)}
        for (l, e), future in futures.items():
            np.testing.assert_array_equal(future.result()["up_proj"], weights(l, e, "up_proj", np.float32))


def test_store_errors_name_file_tensor_and_expert(tmp_path):
    write_stacked(tmp_path, 1, 4, np.float32)
    store = ExpertStore(tmp_path, layout="stacked")
    with pytest.raises(ExpertStoreError, match=r"experts.safetensors.*model.layers.0.mlp.experts.gate_proj.*expert 9"):
        store.read_expert(0, 9)
    with pytest.raises(ExpertStoreError, match=r"expert 1 of layer 5.*model.layers.5.mlp.experts.gate_proj.*experts.safetensors"):
        store.read_expert(5, 1)
    with pytest.raises(ExpertStoreError, match=r"expert 2 of layer 0.*float32\[6, 4\].*expects float32\[4, 6\]"):
        store.read_expert(0, 2, expected={"gate_proj": ((4, 6), np.float32)})
    store.close()


def test_store_catches_a_mis_shaped_expert_by_default(tmp_path):
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": weights(0, e, p, np.float32)
               for e in range(4) for p in PROJECTIONS}
    tensors["model.layers.0.mlp.experts.3.up_proj.weight"] = np.zeros((5, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with ExpertStore(tmp_path) as store:
        np.testing.assert_array_equal(store.read_expert(0, 2)["up_proj"], weights(0, 2, "up_proj", np.float32))
        with pytest.raises(ExpertStoreError, match=r"model.safetensors: tensor model.layers.0.mlp.experts.3.up_proj"
                                                   r".weight \(expert 3 of layer 0\) is float32\[5, 4\]"):
            store.read_expert(0, 3)


def test_store_refuses_a_truncated_file_at_its_header(tmp_path):
    write_stacked(tmp_path, 1, 4, np.float32)
    path = tmp_path / "experts.safetensors"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ExpertStoreError, match="past the end"):
        ExpertStore(tmp_path, layout="stacked")


def test_store_truncated_after_opening_fails_the_read_not_the_slot(tmp_path):
    write_stacked(tmp_path, 1, 4, np.float32)
    path = tmp_path / "experts.safetensors"
    store = ExpertStore(tmp_path, layout="stacked")
    path.write_bytes(path.read_bytes()[:-40])
    arena = NumpyArena(1, 2, {p: (SHAPES[p], np.float32) for p in PROJECTIONS})
    manager = ResidencyManager(1, 4, 2, loader=lambda l, e, s: store.read_expert(l, e), arena=arena, queue_depth=2)
    manager.step([report([0, 3], table=manager.snapshot()[0])])
    manager.drain()
    assert manager.resident(0) == {}  # the file changed under the store: no read is trusted
    assert {f.expert for f in manager.failures.values()} == {0, 3}
    assert all("changed after its header was read" in f.message for f in manager.failures.values())
    assert not arena.arrays["down_proj"].any(), "a failed slot was written"
    manager.close()
    store.close()


def test_store_with_manager_and_route_shed_end_to_end(tmp_path):
    write_per_expert(tmp_path, 2, 8, np.float32)
    with ExpertStore(tmp_path, layout="per_expert") as store:
        arena = NumpyArena(2, 3, store.expert_shapes(0))
        manager = ResidencyManager(2, 8, 3, loader=lambda l, e, s: store.read_expert(l, e), arena=arena,
                                   queue_depth=4, bytes_per_expert=store.expert_nbytes(0))
        rng = np.random.default_rng(3)
        tables = manager.snapshot()
        for _ in range(20):
            reports = []
            for layer in range(2):
                ids = rng.choice(8, (2, 2), replace=False).astype(np.int32)
                scores = np.full((2, 2), 0.5, np.float32)
                out = route_shed(ids, scores, tables[layer])
                for expert in np.flatnonzero(tables[layer] >= 0):  # what a gather would read
                    np.testing.assert_array_equal(arena.arrays["up_proj"][layer, tables[layer, expert]],
                                                  weights(layer, expert, "up_proj", np.float32))
                reports.append(LayerReport(ids, scores, out.miss_ids, out.miss_scores))
            tables = manager.step(reports)
        manager.drain()
        _, total = manager.stats()
        assert total.bytes_read == total.reads_landed * store.expert_nbytes(0) > 0
        manager.close()


# ---- framework adapters ----------------------------------------------------------------------


def test_jax_arena_writes_one_slot_and_donates():
    pytest.importorskip("jax")
    from kq_jax.arena import JaxArena

    arena = JaxArena(2, 3, {"w": ((4, 5), np.float32), "b": ((5,), ml_dtypes.bfloat16)})
    before = arena.arrays["w"]
    arena.write_slot(1, 2, {"w": np.ones((4, 5), np.float32), "b": np.full(5, 2, ml_dtypes.bfloat16)})
    w = np.asarray(arena.arrays["w"])
    assert w[1, 2].sum() == 20 and w.sum() == 20
    assert np.asarray(arena.arrays["b"], np.float32)[1, 2].tolist() == [2.0] * 5
    assert before.is_deleted(), "the old arena buffer was not donated"


def test_mlx_arena_writes_one_slot():
    pytest.importorskip("mlx.core")
    from kq_mlx.arena import MlxArena

    arena = MlxArena(2, 3, {"w": ((4, 5), ml_dtypes.bfloat16)})
    arena.write_slot(0, 1, {"w": np.full((4, 5), 3, ml_dtypes.bfloat16)})
    w = np.array(arena.arrays["w"].astype(__import__("mlx.core").core.float32))
    assert w[0, 1].sum() == 60 and w.sum() == 60


@pytest.mark.parametrize("batch", [False, True], ids=["write_slot", "write_slots"])
def test_mlx_arena_writes_back_to_back_in_place(batch):
    """Writes one after another update the arena in place: MLX's peak memory over 32 writes into a 32 MiB
    array stays within a few slots of the start (a write built while the last one was still queued copied
    the whole array: 726 MiB over the start here, write_slot)."""
    mx = pytest.importorskip("mlx.core")
    from kq_mlx.arena import MlxArena

    arena = MlxArena(4, 8, {"w": ((512, 512), np.float32)})  # 32 MiB, a slot 1 MiB
    mx.eval(arena.arrays["w"])
    payload = {"w": np.random.default_rng(3).standard_normal((512, 512)).astype(np.float32)}
    mx.synchronize()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    for write in range(32):
        layer, slot = divmod(write, 8)
        if batch:
            assert arena.write_slots(np.array([layer]), np.array([slot]), [payload]) == [None]
        else:
            arena.write_slot(layer, slot, payload)
    mx.synchronize()
    assert mx.get_peak_memory() - start < 8 * 2**20
    assert np.array(arena.arrays["w"][3, 7]).tobytes() == payload["w"].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.uint32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_mlx_arena_takes_a_payload_of_negative_strides(dtype):
    """A payload viewed backwards (``[::-1]``: MLX refuses negative strides) is written as any other, every
    array of it (a refused one left the arrays before it written)."""
    pytest.importorskip("mlx.core")
    from kq_mlx.arena import MlxArena

    arena = MlxArena(1, 2, {"v": ((6,), dtype), "w": ((4, 5), dtype)})
    rng = np.random.default_rng(4)
    payload = {"v": (rng.standard_normal(6) * 100).astype(dtype),
               "w": (rng.standard_normal((4, 5)) * 100).astype(dtype)[::-1, ::-1]}
    arena.write_slot(0, 1, payload)
    assert arena.write_slots(np.array([0]), np.array([0]), [payload]) == [None]
    for name, value in payload.items():
        got = arena.arrays[name]
        got = np.array(got.view(__import__("mlx.core").core.uint16) if np.dtype(dtype).itemsize == 2 else got)
        for slot in (0, 1):
            assert got[0, slot].tobytes() == np.ascontiguousarray(value).view(got.dtype).tobytes(), (name, slot)


@pytest.mark.parametrize("kind", ["jax", "mlx"])
def test_write_slots_leaves_what_one_write_after_another_leaves(kind):
    """A batch across layers, with a slot written twice and a refused payload between, gives the bits that
    write_slot called in order gives (random data, bf16 and float32 payloads into a float32 arena)."""
    if kind == "jax":
        pytest.importorskip("jax")
        from kq_jax.arena import JaxArena as Arena
    else:
        pytest.importorskip("mlx.core")
        from kq_mlx.arena import MlxArena as Arena
    shapes = {"w": ((6, 5), np.float32), "i": ((3,), np.uint32)}
    rng = np.random.default_rng(11)
    layers, slots = np.array([1, 0, 1, 1, 0, 1]), np.array([2, 0, 0, 2, 1, 0])
    payloads = [{"w": (rng.standard_normal((6, 5)) * 1e3).astype(ml_dtypes.bfloat16 if n % 2 else np.float32),
                 "i": rng.integers(0, 2**32, 3, dtype=np.uint32)} for n in range(6)]
    payloads[5] = {"w": payloads[5]["w"]}  # refused: a projection missing
    batched, one_by_one = Arena(2, 3, shapes), Arena(2, 3, shapes)
    errors = batched.write_slots(layers, slots, payloads)
    assert [error is None for error in errors] == [True] * 5 + [False]
    for layer, slot, payload in zip(layers[:5].tolist(), slots[:5].tolist(), payloads[:5]):
        one_by_one.write_slot(layer, slot, payload)
    for name in shapes:
        assert np.asarray(batched.arrays[name]).tobytes() == np.asarray(one_by_one.arrays[name]).tobytes(), name


def test_holds_every_expert_is_true_only_for_a_table_that_cannot_miss():
    from kq_core.contract import holds_every_expert

    tables = np.array([[2, 0, 1, 3],     # every expert in a slot
                       [2, 0, -1, 3],    # one not resident
                       [2, 0, 4, 3],     # one past the arena's 4 slots
                       [3, 3, 3, 3]])    # all in one slot: still no miss
    assert holds_every_expert(tables, 4).tolist() == [True, False, False, True]
    assert holds_every_expert(tables[0], 4).shape == () and bool(holds_every_expert(tables[0], 3)) is False
    assert holds_every_expert(np.zeros((2, 0), np.int32), 4).tolist() == [False, False]
    with pytest.raises(ValueError, match="slot_tables"):
        holds_every_expert(np.int32(0), 4)
