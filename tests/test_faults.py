"""The host side on a bad day: failing and hanging loaders, wrong payloads, bad arguments, two threads."""

import gc
import threading
import time

import numpy as np
import pytest

from kq import route_shed
from kq_host.arena import ExpertPayloadError, NumpyArena
from kq_host.residency import LayerReport, ResidencyManager

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
    gc.collect()
    before = len(gc.get_objects())
    decode(manager, tokens, layers=2)
    gc.collect()
    assert len(manager.failures) <= 2 * 64
    assert len(gc.get_objects()) < before + 5_000


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
    release = threading.Event()

    def loader(layer, expert, slot):
        release.wait(5)
        return 0

    manager = ResidencyManager(1, 4, 2, loader=loader, queue_depth=1)
    decode(manager, [[0, 1]])
    start = time.perf_counter()
    out = manager.drain(timeout=0.2)
    assert time.perf_counter() - start < 2 and sorted(read.expert for read in out) == [0, 1]
    out = manager.close(timeout=0.2)
    assert time.perf_counter() - start < 4 and out
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
    (dict(pinned={0: [9]}), "pinned"), (dict(pinned={3: [1]}), "pinned"), (dict(decay_interval=-1), "decay_interval"),
])
def test_manager_arguments_are_checked(kwargs, argument):
    args = dict(num_layers=1, num_experts=8, num_slots=2) | kwargs
    with pytest.raises(ValueError, match=argument):
        ResidencyManager(args.pop("num_layers"), args.pop("num_experts"), args.pop("num_slots"),
                         loader=lambda *a: 0, **args)


@pytest.mark.parametrize("layer, experts, argument", [(0, [-2], "experts"), (0, [8], "experts"), (1, [0], "layer")])
def test_preload_refuses_ids_outside_the_table(layer, experts, argument):
    manager = ResidencyManager(1, 8, 2, loader=lambda *a: 0, queue_depth=0)
    with pytest.raises(ValueError, match=argument):
        manager.preload(layer, experts)
    assert manager.resident(0) == {}


def test_out_of_range_misses_are_refused_before_anything_is_credited():
    manager = ResidencyManager(1, 4, 2, loader=lambda *a: 0, queue_depth=0)
    bad = LayerReport(np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32),
                      np.array([[7, -1]], np.int32), np.array([[0.5, 0]], np.float32))
    with pytest.raises(ValueError, match="miss_ids"):
        manager.step([bad])
    _, total = manager.stats()
    assert total.lookups == 0 and manager.token == 0


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
