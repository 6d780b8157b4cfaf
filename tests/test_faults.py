"""The host side on a bad day: failing and hanging loaders, wrong payloads, bad arguments, two threads."""

import gc
import importlib.util
import threading
import time

import numpy as np
import pytest

from kq import route_shed
from kq_host.arena import ExpertPayloadError, NumpyArena
from kq_host.residency import MAX_BYTE_COUNT, LayerReport, ResidencyManager

SHAPES = {"gate_proj": ((4, 3), np.float32), "down_proj": ((3, 4), np.float32)}


def report(ids, table):
    ids = np.array(ids, np.int32).reshape(1, -1)
    scores = np.full(ids.shape, 1.0 / ids.shape[1], np.float32)
    out = route_shed(ids, scores, table)
    return LayerReport(ids, scores, out.miss_ids, out.miss_scores)


def decode(manager, tokens, layers=1):
    tables = manager.snapshot()
    for ids in tokens:
        tables = manager.step([report(ids, tables[layer]) for layer in range(layers)])
    return tables


def payload(value=1.0):
    return {name: np.full(shape, value, dtype) for name, (shape, dtype) in SHAPES.items()}


# ---- failing reads ----------------------------------------------------------------------------


def test_a_read_that_keeps_failing_keeps_a_bounded_record_and_backs_off():
    calls = []

    def loader(layer, expert, slot):
        calls.append(expert)
        ballast = np.ones(2**18)  # held by the traceback's frame if the error kept it
        raise OSError(f"bad sector under expert {expert} ({ballast.size})")

    manager = ResidencyManager(1, 8, 2, loader=loader, queue_depth=0)
    decode(manager, [[3, 5]] * 2000)
    failure = manager.failures[(0, 3)]
    assert len(manager.failures) == 2 and failure.count == len([c for c in calls if c == 3])
    assert failure.error_type == "OSError" and "bad sector under expert 3" in failure.message
    assert not hasattr(failure, "error")  # no exception object, no traceback, no frames kept alive
    assert len(calls) < 2 * 40  # retried with exponential back-off, not once per token
    _, total = manager.stats()
    assert total.reads_failed == len(calls)


def test_failing_reads_do_not_grow_memory():
    def loader(layer, expert, slot):
        ballast = bytearray(2**20)  # noqa: F841 - what a leaked traceback would keep
        raise OSError("truncated tensor")

    manager = ResidencyManager(2, 64, 8, loader=loader, queue_depth=0)
    rng = np.random.default_rng(0)
    tokens = [rng.choice(64, 8, replace=False) for _ in range(10_000)]
    decode(manager, tokens[:500], layers=2)  # warm: caches, the first records
    gc.collect()
    before, rss_before = len(gc.get_objects()), _rss_bytes()
    decode(manager, tokens[500:], layers=2)
    gc.collect()
    assert len(manager.failures) <= 2 * 64
    assert len(gc.get_objects()) < before + 5_000
    if rss_before is not None:
        assert _rss_bytes() - rss_before < 64 * 2**20  # a leaked traceback per failure would be 1 MiB each


def _rss_bytes() -> int | None:
    """The process's resident set now (Linux), or None where /proc is missing."""
    import os

    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def test_a_success_after_failures_clears_the_back_off():
    failing = {"on": True}

    def loader(layer, expert, slot):
        if failing["on"]:
            raise OSError("not yet")
        return 0

    manager = ResidencyManager(1, 4, 2, loader=loader, queue_depth=0)
    decode(manager, [[1]] * 5)
    failing["on"] = False
    tables = decode(manager, [[1]] * 40)
    assert tables[0, 1] >= 0 and (0, 1) not in manager.failures


@pytest.mark.parametrize("queue_depth", [0, 2])
def test_a_loader_raising_a_base_exception_fails_that_read_once(queue_depth):
    class Stop(BaseException):
        pass

    def loader(layer, expert, slot):
        if expert == 2:
            raise Stop("loader gave up")
        return 0

    manager = ResidencyManager(1, 4, 4, loader=loader, queue_depth=queue_depth)
    tables = decode(manager, [[1, 2]])
    manager.drain()
    tables = decode(manager, [[1, 3], [1, 3]])  # no later step re-raises
    manager.drain()
    assert manager.failures[(0, 2)].error_type == "Stop"
    assert 2 not in manager.slot_owner(0).tolist()  # the slot is not left LOADING
    assert tables[0, 1] >= 0
    manager.close()


def test_drain_and_close_time_out_on_a_hanging_loader_and_report_the_reads_out():
    """The loader hangs until released; drain and close each return once their timeout runs out (a generous
    upper bound: well before the loader's own 10 s), listing the reads still out."""
    release, started = threading.Event(), threading.Event()

    def loader(layer, expert, slot):
        started.set()
        release.wait(10)
        return 0

    manager = ResidencyManager(1, 4, 2, loader=loader, queue_depth=1)
    decode(manager, [[0, 1]])
    assert started.wait(10)
    try:
        start = time.perf_counter()
        out = manager.drain(timeout=0.2)
        assert time.perf_counter() - start < 0.2 + 2 and sorted(read.expert for read in out) == [0, 1]
        start = time.perf_counter()
        out = manager.close(timeout=0.2)
        assert time.perf_counter() - start < 0.2 + 2 and sorted(read.expert for read in out) == [0, 1]
    finally:
        release.set()


# ---- payloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, why", [
    ({"gate_proj": np.float32(1), "down_proj": np.ones((3, 4), np.float32)}, "shape"),
    ({"gate_proj": np.ones((1, 3), np.float32), "down_proj": np.ones((3, 4), np.float32)}, "shape"),
    ({"gate_proj": np.ones((4, 3), np.float32)}, "missing"),
    ({**payload(), "up_proj": np.ones((4, 3), np.float32)}, "unexpected"),
    ({"gate_proj": np.ones((4, 3), np.float64), "down_proj": np.ones((3, 4), np.float32)}, "dtype"),
    (7, "mapping"),
])
def test_numpy_arena_refuses_a_payload_that_is_not_the_expert(bad, why):
    arena = NumpyArena(1, 2, SHAPES)
    arena.write_slot(0, 1, payload(5.0))
    with pytest.raises(ExpertPayloadError, match=why):
        arena.write_slot(0, 1, bad)
    assert (arena.arrays["gate_proj"][0, 1] == 5.0).all()  # the slot is untouched


def test_a_wrong_payload_is_a_failed_read_not_a_published_expert():
    arena = NumpyArena(1, 2, SHAPES)

    def loader(layer, expert, slot):
        return payload(expert) if expert != 3 else {"gate_proj": np.ones((1, 3), np.float32)}

    manager = ResidencyManager(1, 6, 2, loader=loader, arena=arena, queue_depth=0)
    tables = decode(manager, [[1, 3], [1, 3]])
    assert tables[0, 3] == -1 and manager.failures[(0, 3)].error_type == "ExpertPayloadError"


def test_jax_and_mlx_arenas_check_payloads_too():
    for module, name in (("kq_jax.arena", "JaxArena"), ("kq_mlx.arena", "MlxArena")):
        arena_class = getattr(pytest.importorskip(module), name)
        arena = arena_class(1, 2, SHAPES)
        with pytest.raises(ExpertPayloadError, match="shape"):
            arena.write_slot(0, 0, {"gate_proj": np.ones((1, 3), np.float32), "down_proj": np.ones((3, 4))})
        with pytest.raises(ExpertPayloadError, match="missing"):
            arena.write_slot(0, 0, {"gate_proj": np.ones((4, 3), np.float32)})


# ---- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, argument", [
    (dict(num_layers=0), "num_layers"), (dict(num_slots=-1), "num_slots"), (dict(num_experts=0), "num_experts"),
    (dict(read_budget=-1), "read_budget"), (dict(queue_depth=-2), "queue_depth"),
    (dict(queue_depth=1_000_000), "queue_depth must be at most 256"),
    (dict(pinned={0: [9]}), "pinned"), (dict(pinned={3: [1]}), "pinned"), (dict(decay_interval=-1), "decay_interval"),
    (dict(impl="cython"), "impl"), (dict(bytes_per_expert=2**63), "bytes_per_expert"),
    (dict(bytes_per_expert=MAX_BYTE_COUNT + 1), "bytes_per_expert"), (dict(read_budget=2**70), "read_budget"),
    (dict(keep_mass="x"), "keep_mass"), (dict(keep_mass=float("nan")), "keep_mass"),
    (dict(pinned={"0": [1]}), "pinned"), (dict(pinned={0: [1.5]}), "pinned"), (dict(pinned=[1]), "pinned"),
])
def test_manager_arguments_are_checked(kwargs, argument):
    args = dict(num_layers=1, num_experts=8, num_slots=2) | kwargs
    with pytest.raises(ValueError, match=argument):
        ResidencyManager(args.pop("num_layers"), args.pop("num_experts"), args.pop("num_slots"),
                         loader=lambda *a: 0, **args)


@pytest.mark.parametrize("module, name", [("kq_host.arena", "NumpyArena"), ("kq_jax.arena", "JaxArena"),
                                          ("kq_mlx.arena", "MlxArena")])
def test_a_manager_of_another_shape_than_its_arena_is_refused(module, name):
    """A manager maps experts to slots of its own count: over an arena of other slots or layers, a slot past
    the arena's was written nowhere (MLX) or a negative one into the last, and its tokens were wrong."""
    arena = getattr(pytest.importorskip(module), name)(2, 3, SHAPES)
    assert arena.shape == (2, 3)
    for layers, slots in ((2, 4), (2, 2), (3, 3), (1, 3)):
        with pytest.raises(ValueError, match=rf"ResidencyManager: the arena holds 2 layers of 3 slots; the manager "
                                             rf"has {layers} layers of {slots} slots"):
            ResidencyManager(layers, 8, slots, loader=lambda *a: payload(1.0), arena=arena, queue_depth=0)
    ResidencyManager(2, 8, 3, loader=lambda *a: payload(1.0), arena=arena, queue_depth=0).close()


@pytest.mark.parametrize("module, name", [("kq_host.arena", "NumpyArena"), ("kq_jax.arena", "JaxArena"),
                                          ("kq_mlx.arena", "MlxArena")])
def test_an_arena_of_no_slots_or_no_shape_is_refused_by_name(module, name):
    arena_class = getattr(pytest.importorskip(module), name)
    for arguments, argument in (((2, 0, SHAPES), "num_slots"), ((0, 3, SHAPES), "num_layers"),
                                ((2, 1.5, SHAPES), "num_slots"), ((2, 3, {}), "shapes"),
                                ((2, 3, {"gate_proj": ((-1, 3), np.float32)}), r"shapes\['gate_proj'\]"),
                                ((2, 3, {"gate_proj": ((4, 3.0), np.float32)}), r"shapes\['gate_proj'\]")):
        with pytest.raises(ValueError, match=rf"{name}: {argument}"):
            arena_class(*arguments)
    if name == "JaxArena":
        import jax

        if not jax.config.jax_enable_x64:
            with pytest.raises(ValueError, match=r"JaxArena: shapes\['gate_proj'\]'s dtype float64 is not one JAX"):
                arena_class(2, 3, {"gate_proj": ((4, 3), np.float64)})


@pytest.mark.parametrize("module, name", [("kq_host.arena", "NumpyArena"), ("kq_jax.arena", "JaxArena"),
                                          ("kq_mlx.arena", "MlxArena")])
def test_a_write_outside_the_arena_is_refused_by_name(module, name):
    """A slot past the arena was written nowhere (JAX, MLX), -1 wrote the last slot, 1.9 slot 1: each is
    refused naming the index, alone in a batch (the others written), and a batch of unequal lengths whole."""
    arena = getattr(pytest.importorskip(module), name)(2, 3, SHAPES)
    for layer, slot, argument in ((0, 3, "slot"), (0, -1, "slot"), (2, 0, "layer"), (-1, 0, "layer"),
                                  (0, 1.9, "slot"), (0, "1", "slot"), (True, 0, "layer")):
        with pytest.raises(ValueError, match=rf"write_slot: {argument} must be an int in \[0, [23]\)"):
            arena.write_slot(layer, slot, payload(5.0))
    if name != "NumpyArena":  # the host arena is written slot by slot
        errors = arena.write_slots(np.array([0, 1, 1]), np.array([3, 2, -1]), [payload(6.0)] * 3)
        assert errors[1] is None and all(isinstance(errors[i], ValueError) for i in (0, 2))
        for layers, slots, count in (([0, 1], [0], 1), ([0], [0], 2), (0, 0, 1), ([[0]], [[0]], 1), ([0.0], [0.0], 1)):
            with pytest.raises(ValueError, match="write_slots: layers and slots must be 1-D integer arrays"):
                arena.write_slots(layers, slots, [payload(7.0)] * count)
    gate = np.asarray(arena.arrays["gate_proj"], np.float32)
    assert (gate[1, 2] == (6.0 if name != "NumpyArena" else 0.0)).all()
    assert (np.delete(gate.reshape(6, -1), 5, axis=0) == 0.0).all()  # nothing else written


@pytest.mark.parametrize("fails", ["start", "construction"])
@pytest.mark.parametrize("after", [0, 3])
def test_a_pool_that_cannot_start_its_threads_stops_those_it_started(monkeypatch, fails, after):
    """The threads a manager's loader pool started before one failed to start (or to be made) are stopped,
    not left behind, and the error is the one that stopped it."""
    start, init, started, made = threading.Thread.start, threading.Thread.__init__, [], []

    def start_some(thread):
        if fails == "start" and len(started) == after:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    def make_some(thread, *args, **kwargs):
        if fails == "construction" and len(made) == after:
            raise MemoryError("no thread object")
        made.append(thread)
        init(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", start_some)
    monkeypatch.setattr(threading.Thread, "__init__", make_some)
    with pytest.raises(RuntimeError if fails == "start" else MemoryError):
        ResidencyManager(1, 8, 2, loader=lambda *a: 0, queue_depth=8)
    monkeypatch.undo()
    for thread in started:
        thread.join(timeout=5)
    assert len(started) == after and not any(thread.is_alive() for thread in started)


@pytest.mark.parametrize("layer, experts, argument", [(0, [-2], "experts"), (0, [8], "experts"), (1, [0], "layer")])
def test_preload_refuses_ids_outside_the_table(layer, experts, argument):
    manager = ResidencyManager(1, 8, 2, loader=lambda *a: 0, queue_depth=0)
    with pytest.raises(ValueError, match=argument):
        manager.preload(layer, experts)
    assert manager.resident(0) == {}


@pytest.mark.parametrize("queue_depth", [0, 2], ids=["inline-loads", "loader-threads"])
@pytest.mark.parametrize("held", [[], [1]], ids=["empty-layer", "one-resident"])
def test_a_preload_past_the_free_slots_is_refused_before_it_claims_or_reads_anything(queue_depth, held):
    reads = []

    def loader(layer, expert, slot):
        reads.append(expert)
        return {"w": np.full(2, expert, np.float32)}

    manager = ResidencyManager(1, 16, 4, arena=NumpyArena(1, 4, {"w": ((2,), np.float32)}), loader=loader,
                               queue_depth=queue_depth, impl="numpy")
    try:
        manager.preload(0, held)
        reads.clear()
        owners = manager.slot_owner(0)
        with pytest.raises(ValueError, match=rf"preload: layer 0 has {4 - len(held)} free slots? for the 5 experts "
                                             rf"not resident or loading \[2, 3, 4, 5, 6\]"):
            manager.preload(0, [*held, 2, 3, 4, 5, 6])  # the resident one is skipped, not counted
        assert reads == [] and manager.pending() == []
        np.testing.assert_array_equal(manager.slot_owner(0), owners)
        assert manager.resident(0) == {e: s for s, e in enumerate(held)}
        manager.preload(0, [*held, 2, 3, 4])  # what fits still loads
        assert sorted(manager.resident(0)) == [*held, 2, 3, 4]
    finally:
        manager.close()


def test_out_of_range_misses_are_refused_before_anything_is_credited():
    manager = ResidencyManager(1, 4, 2, loader=lambda *a: 0, queue_depth=0)
    bad = LayerReport(np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32),
                      np.array([[7, -1]], np.int32), np.array([[0.5, 0]], np.float32))
    with pytest.raises(ValueError, match="miss_ids"):
        manager.step([bad])
    _, total = manager.stats()
    assert total.lookups == 0 and manager.token == 0


IMPLS = [pytest.param("numpy"), pytest.param("numba", marks=pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="needs Numba"))]


@pytest.mark.parametrize("impl", IMPLS)
def test_hits_and_misses_are_what_the_token_was_served_on_whatever_tables_it_ran(impl):
    """A pipelined loop runs token t + 1 on tables older than the manager's last snapshot: its hits and
    misses, and its shed mass, are the report's (the misses route_shed gave it), not a later table's."""
    manager = ResidencyManager(1, 4, 2, loader=lambda *a: None, queue_depth=0, impl=impl)
    ran = {0: manager.snapshot(), 1: manager.snapshot()}
    missed = 0
    for token in range(4):
        ids = np.array([[1]], np.int32)
        scores = np.ones((1, 1), np.float32)
        shed = route_shed(ids, scores, ran[token][0])
        missed += int((np.asarray(shed.miss_ids) >= 0).sum())
        ran[token + 2] = manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)])
    _, total = manager.stats()
    assert missed == 3
    assert (total.misses, total.hits, total.shed_mass) == (3, 1, 3.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_score_that_is_no_number_counts_as_no_mass(impl):
    manager = ResidencyManager(1, 8, 3, loader=lambda *a: None, queue_depth=0, impl=impl)
    for score in (np.inf, -np.inf, np.nan, 0.5):
        manager.step([LayerReport(np.array([[1]]), np.array([[score]]), np.array([[1]]), np.array([[1.0]]))])
    _, total = manager.stats()
    assert total.routed_mass == 0.5 and total.shed_mass == 0.5 and total.lookups == 4


@pytest.mark.parametrize("call, argument", [
    (lambda m: m.preload(0.5, [1]), "layer"), (lambda m: m.preload("0", [1]), "layer"),
    (lambda m: m.preload(0, [1.5]), "experts"), (lambda m: m.resident(9), "layer"), (lambda m: m.resident(-1), "layer"),
    (lambda m: m.slot_owner(9), "layer"), (lambda m: m.step(5), "reports"), (lambda m: m.step([1, 2]), "reports"),
], ids=["preload-float-layer", "preload-str-layer", "preload-float-expert", "resident-past", "resident-negative",
        "slot_owner-past", "step-int", "step-list-of-ints"])
def test_a_layer_or_report_of_the_wrong_kind_is_refused_by_name(call, argument):
    manager = ResidencyManager(2, 8, 3, loader=lambda *a: None, queue_depth=0)
    with pytest.raises(ValueError, match=argument):
        call(manager)
    assert manager.stats()[1].lookups == 0 and manager.token == 0


def test_jax_and_numpy_integer_scalars_are_layers_and_ids():
    jnp = pytest.importorskip("jax.numpy")
    from kq_host.prestage import prestage_order

    manager = ResidencyManager(2, 8, 3, loader=lambda *a: None, queue_depth=0, keep_mass=np.array(0.9),
                               pinned={0: jnp.array([1, 2])})
    manager.preload(jnp.int32(1), jnp.array([4, 5]))
    manager.preload(np.array(0), np.array([1, 2], np.uint32))
    assert manager.resident(jnp.int32(1)) == {4: 0, 5: 1} and sorted(manager.resident(np.array(0))) == [1, 2]
    assert list(manager.slot_owner(np.int64(0))[:2]) == [1, 2]
    assert prestage_order([], [], 8).expert_ids.size == 0


@pytest.mark.parametrize("ids", [np.array([[3.7, 1.2]]), np.array([[2**64 - 1, 1]], np.uint64)],
                         ids=["float-ids", "uint64-past-int64"])
def test_ids_that_are_no_int64_ids_are_refused_not_coerced(ids):
    from kq_host.prestage import prestage_order

    scores = np.full(ids.shape, 0.5, np.float32)
    with pytest.raises(ValueError, match="miss_ids"):
        prestage_order(ids, scores, 8)
    manager = ResidencyManager(1, 8, 3, loader=lambda *a: None, queue_depth=0)
    with pytest.raises(ValueError, match="miss_ids"):
        manager.step([LayerReport(np.array([[1, 2]]), scores, ids, scores)])
    with pytest.raises(ValueError, match="indices"):
        manager.step([LayerReport(ids, scores, np.full((1, 2), -1), scores)])
    assert manager.stats()[1].lookups == 0 and manager.token == 0
    with pytest.raises(ValueError, match="layers must hold one report"):
        LayerReport.stacked([])


@pytest.mark.parametrize("shape, message", [((3, 1, 2), "expected 2 layer reports"),
                                            ((2, 1, 2), "scores must have the shape"), ((), "expected 2")])
def test_a_stacked_report_must_carry_every_layer(shape, message):
    """One report of [L, T, K] arrays: a wrong leading dimension or mismatched fields are refused, naming
    them, before anything is credited."""
    manager = ResidencyManager(2, 4, 2, loader=lambda *a: 0, queue_depth=0)
    ids = np.zeros(shape, np.int32)
    scores = np.zeros((2, 1, 3), np.float32) if message.startswith("scores") else np.full(shape, 0.5, np.float32)
    with pytest.raises(ValueError, match=message):
        manager.step(LayerReport(ids, scores, np.full(shape, -1, np.int32), np.zeros(shape, np.float32)))
    assert manager.stats()[1].lookups == 0 and manager.token == 0


# ---- threads ----------------------------------------------------------------------------------


def test_step_from_two_threads_at_once_is_refused():
    entered, release = threading.Event(), threading.Event()

    def fence():
        entered.set()
        release.wait(5)

    manager = ResidencyManager(1, 4, 2, loader=lambda *a: 0, queue_depth=0)
    table = manager.snapshot()[0]
    worker = threading.Thread(target=lambda: manager.step([report([0, 1], table)], fence=fence))
    worker.start()
    entered.wait(5)
    with pytest.raises(RuntimeError, match="two threads"):
        manager.step([report([2, 3], table)])
    release.set()
    worker.join()


# ---- safetensors headers ----------------------------------------------------------------------


def write_raw(path, header, data: bytes, length=None):
    import json
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, data, length, message", [
    ({}, b"", 2**63, "header length"),
    ({}, b"", 2**40, "header length"),
    (b"[1, 2]", b"", None, "JSON object"),
    ({"t": {"shape": [4], "data_offsets": [0, 16]}}, bytes(16), None, "tensor t"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, bytes(16), None, "data_offsets"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}}, bytes(16), None, "data_offsets"),
    ({"t": {"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None, "8 bytes"),
    ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}}, bytes(16), None, "past the end"),
    ({"a": F32_4, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16), None, "overlap"),
    (b'{"t": ' + b'{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "t": '
     b'{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', bytes(16), None, "twice"),
    ({"t": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, bytes(16), None, "shape"),
    ({"t": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}}, bytes(16), None, "takes"),
    ({"t": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 16]}}, bytes(16), None, "shape"),
    ({"t": {"dtype": "F32", "shape": [0], "data_offsets": [False, False]}}, bytes(16), None, "data_offsets"),
    ('{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'.encode("utf-16"), bytes(16), None,
     "unreadable"),
    (b"[" * 200_000 + b"]" * 200_000, b"", None, "unreadable"),
    ({"t": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}}, bytes(16), None, "shape"),
    ({"t": {"dtype": "F32", "shape": [1] * 70, "data_offsets": [0, 4]}}, bytes(16), None, "shape"),
], ids=["length-2^63", "length-2^40", "json-list", "no-dtype", "begin-after-end", "negative-offset",
        "f16-over-f32-bytes", "past-the-end", "overlap", "duplicate-key", "negative-shape", "shape-wraps-int64",
        "shape-past-int64", "boolean-offsets", "utf16-header", "nested-json", "empty-dim-past-int64", "70-dims"])
def test_store_refuses_a_malformed_header_naming_the_file(tmp_path, header, data, length, message):
    from kq_host.expert_store import ExpertStoreError, read_safetensors_header

    path = write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(ExpertStoreError, match=message) as error:
        read_safetensors_header(path)
    assert "bad.safetensors" in str(error.value)


def expert_file(path, experts=2, dtype="F32"):
    header, offset = {}, 0
    for expert in range(experts):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            header[f"model.layers.0.mlp.experts.{expert}.{projection}.weight"] = {
                "dtype": dtype, "shape": [2, 2], "data_offsets": [offset, offset + 16]}
            offset += 16
    return write_raw(path, header, np.arange(offset // 4, dtype=np.float32).tobytes())


def test_store_refuses_the_same_tensor_in_two_files(tmp_path):
    from kq_host.expert_store import ExpertStore, ExpertStoreError

    expert_file(tmp_path / "a.safetensors")
    expert_file(tmp_path / "b.safetensors")
    with pytest.raises(ExpertStoreError, match="a.safetensors.*b.safetensors|b.safetensors.*a.safetensors"):
        ExpertStore(tmp_path)


def test_store_notices_a_file_changed_after_its_header_was_read(tmp_path):
    import os

    from kq_host.expert_store import ExpertStore, ExpertStoreError

    path = expert_file(tmp_path / "experts.safetensors")
    store = ExpertStore(tmp_path)
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(99).tobytes()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))  # a different modification time, as any rewrite has
    with pytest.raises(ExpertStoreError, match="changed"):
        store.read_expert(0, 1)
    store.close()


@pytest.mark.parametrize("make", ["directory", "dangling-link", "link-loop"])
def test_store_refuses_what_is_no_file_with_its_own_error(tmp_path, make):
    from kq_host.expert_store import ExpertStore, ExpertStoreError

    expert_file(tmp_path / "good.safetensors")
    bad = tmp_path / "bad.safetensors"
    if make == "directory":
        bad.mkdir()
    elif make == "dangling-link":
        bad.symlink_to(tmp_path / "gone.safetensors")
    else:
        bad.symlink_to(bad)
    with pytest.raises(ExpertStoreError, match="bad.safetensors: cannot be opened"):
        ExpertStore(tmp_path)


def test_store_refuses_a_fifo_instead_of_waiting_for_a_writer(tmp_path):
    import os

    from kq_host.expert_store import ExpertStore, ExpertStoreError

    expert_file(tmp_path / "good.safetensors")
    os.mkfifo(tmp_path / "pipe.safetensors")
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(pytest.raises(ExpertStoreError, ExpertStore, tmp_path)),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "ExpertStore blocked on a FIFO"
    assert "pipe.safetensors" in str(outcome[0].value) and "regular file" in str(outcome[0].value)


def test_a_metadata_change_does_not_stop_an_open_store(tmp_path):
    """A chmod or a hardlink moves a file's change time, not its bytes: the store reads on."""
    import os

    from kq_host.expert_store import ExpertStore

    path = expert_file(tmp_path / "experts.safetensors")
    with ExpertStore(tmp_path) as store:
        before = store.read_expert(0, 1)
        os.chmod(path, 0o444)
        os.link(path, tmp_path / "linked.bin")
        after = store.read_expert(0, 1)
    assert all(np.array_equal(before[name], after[name]) for name in before)


def test_a_file_deleted_before_its_first_read_is_named(tmp_path):
    from kq_host.expert_store import ExpertStore, ExpertStoreError

    path = expert_file(tmp_path / "experts.safetensors")
    with ExpertStore(tmp_path) as store:
        path.unlink()
        with pytest.raises(ExpertStoreError, match="experts.safetensors"):
            store.read_expert(0, 1)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(template="model.layers.{layer}.{expert}.{projection}.{x}"), "template"),
    (dict(template="model.layers.{layer}.{expert}.{projection}.{0}"), "template"),
    (dict(queue_depth=0), "queue_depth"), (dict(queue_depth="8"), "queue_depth"), (dict(projections=()), "projections"),
], ids=["template-unknown-field", "template-positional", "queue-depth-0", "queue-depth-str", "no-projections"])
def test_store_arguments_are_checked_by_name(tmp_path, kwargs, argument):
    from kq_host.expert_store import ExpertStore

    expert_file(tmp_path / "experts.safetensors")
    with pytest.raises(ValueError, match=argument):
        ExpertStore(tmp_path, **kwargs)


def test_a_store_or_a_manager_dropped_without_close_leaks_no_file_or_thread(tmp_path):
    import os

    from kq_host.expert_store import ExpertStore

    expert_file(tmp_path / "experts.safetensors")
    gc.collect()
    descriptors, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(10):
        store = ExpertStore(tmp_path)
        store.read_expert(0, 1)
        manager = ResidencyManager(1, 4, 2, loader=lambda *a: None, queue_depth=4)
        del store, manager
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert threading.active_count() == threads


def test_store_notices_a_file_replaced_after_its_first_read(tmp_path):
    import os

    from kq_host.expert_store import ExpertStore, ExpertStoreError

    path = expert_file(tmp_path / "experts.safetensors")
    store = ExpertStore(tmp_path)
    store.read_expert(0, 0)  # the file's descriptor is open now
    replacement = expert_file(tmp_path / "new.tmp")
    os.replace(replacement, path)  # what a save through a temporary file does
    with pytest.raises(ExpertStoreError, match="changed"):
        store.read_expert(0, 1)
    store.close()


def test_a_per_expert_template_must_name_the_expert(tmp_path):
    from kq_host.expert_store import ExpertStore

    expert_file(tmp_path / "experts.safetensors")
    with pytest.raises(ValueError, match="template.*lacks \\{expert\\}"):
        ExpertStore(tmp_path, template="model.layers.{layer}.mlp.experts.0.{projection}.weight")


def test_store_catches_a_tensor_declared_with_another_dtype(tmp_path):
    from kq_host.expert_store import ExpertStore, ExpertStoreError

    path = expert_file(tmp_path / "experts.safetensors")
    import json
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header["model.layers.0.mlp.experts.1.up_proj.weight"]["dtype"] = "I32"
    write_raw(path, header, raw[8 + length:])
    with ExpertStore(tmp_path) as store, pytest.raises(ExpertStoreError, match="int32"):
        store.read_expert(0, 1)


# ---- route_shed's input errors -----------------------------------------------------------------


@pytest.mark.parametrize("framework", ["numpy", "jax", "mlx"])
def test_a_wrong_dtype_is_a_value_error_and_a_type_error_naming_the_argument(framework):
    import kq

    ids, scores, table = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float64), np.zeros(4, np.int32)
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        ids, table = jnp.asarray(ids), jnp.asarray(table)
    elif framework == "mlx":
        mx = pytest.importorskip("mlx.core")
        ids, table = mx.array(ids), mx.array(table)
    for caught in (ValueError, TypeError, kq.RouteShedArgumentError):
        with pytest.raises(caught, match="scores") as error:
            kq.route_shed(ids, scores, table)
        assert error.value.argument == "scores"
    with pytest.raises(ValueError, match="slot_table") as error:
        kq.route_shed(np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32), np.zeros((2, 2), np.int32))
    assert isinstance(error.value, kq.RouteShedArgumentError) and not isinstance(error.value, TypeError)


def test_mlx_route_shed_takes_a_numpy_slot_table():
    mx = pytest.importorskip("mlx.core")
    import kq_mlx

    from kq_core.oracle import route_shed_oracle

    ids, scores = np.array([[3, 1]], np.uint32), np.array([[0.75, 0.25]], np.float32)
    table = np.array([-1, 0, -1, 1], np.int32)
    out = kq_mlx.route_shed(mx.array(ids), mx.array(scores), table, stream=mx.cpu)
    assert np.array(out.mix).tolist() == route_shed_oracle(ids, scores, table).mix.tolist()


def test_top_k_true_is_not_an_int():
    from kq_core.oracle import topk_route_shed_oracle

    with pytest.raises(ValueError, match="top_k"):
        topk_route_shed_oracle(np.ones((1, 4), np.float32), np.zeros(4, np.int32), True)


# ---- a slot table that points past the arena ----------------------------------------------------


def test_the_jax_arena_layer_sheds_a_slot_past_the_arena_instead_of_clamping():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from kq_jax.arena_moe import moe_ffn_arena
    from kq_jax.moe import Experts

    rng = np.random.default_rng(0)
    experts, slots, hidden, ffn = 8, 4, 16, 8
    arena = Experts(*(jnp.asarray(rng.normal(size=s).astype(np.float32))
                      for s in [(slots, ffn, hidden), (slots, ffn, hidden), (slots, hidden, ffn)]))
    router, x = jnp.asarray(rng.normal(size=(hidden, experts)), jnp.float32), jnp.asarray(rng.normal(size=(3, hidden)),
                                                                                          jnp.float32)
    table = np.array([0, 1, 2, 3, 100000, slots, -1, -1], np.int32)
    y, routing = moe_ffn_arena(x, router, arena, table, top_k=8)
    clean = np.where(table >= slots, -1, table).astype(np.int32)
    want, _ = moe_ffn_arena(x, router, arena, clean, top_k=8)
    assert np.array_equal(np.asarray(y), np.asarray(want))
    assert int(np.asarray(routing.shed.slots).max()) < slots
    assert {4, 5} <= set(np.asarray(routing.shed.miss_ids).ravel().tolist())


def test_the_mlx_lm_adapter_never_gathers_past_the_arena():
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import qwen3_moe

    from kq_mlx.mlx_lm_adapter import attach_arena, set_tables

    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=16,
        rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
        tie_word_embeddings=False, max_position_embeddings=64, norm_topk_prob=False)
    model = qwen3_moe.Model(args)
    blocks = attach_arena(model, 4)
    set_tables(blocks, np.array([[0, 100000, 1, 2**31 - 1, 2, 3, 4, 5]], np.int32))  # 1, 3, 6, 7 past the arena
    logits = model(mx.array([[1, 2, 3, 4, 5]]))
    mx.eval(logits)
    _, _, shed = blocks[0].last
    assert np.isfinite(np.array(logits)).all() and int(np.array(shed.slots).max()) < 4


@pytest.mark.parametrize("module, name", [("kq_host.arena", "NumpyArena"), ("kq_jax.arena", "JaxArena"),
                                          ("kq_mlx.arena", "MlxArena")])
def test_a_batch_write_writes_the_good_payloads_and_names_the_bad_one(module, name):
    """A boundary's landed experts go in at once; one refused payload among them leaves its slot
    untouched, the others written, and is reported per write, through the manager as a failed read."""
    from kq_host.arena import write_landed

    arena = getattr(pytest.importorskip(module), name)(2, 3, SHAPES)
    bad = {"gate_proj": np.ones((1, 3), np.float32)}
    errors = write_landed(arena, np.array([0, 1, 1]), np.array([2, 0, 1]), [payload(4.0), bad, payload(6.0)])
    assert errors[0] is None and errors[2] is None and isinstance(errors[1], ExpertPayloadError)
    gate = np.asarray(arena.arrays["gate_proj"], np.float32)
    assert (gate[0, 2] == 4.0).all() and (gate[1, 1] == 6.0).all() and (gate[1, 0] == 0.0).all()
    assert (gate[0, :2] == 0.0).all() and (gate[1, 2] == 0.0).all()
