"""What the residency manager waits for, for how long, and how a wait ends: each blocking call waits only
for the reads it needs, within one timeout, with loads inline or on threads; ``close`` from another thread
interrupts a wait with :class:`~kq_host.residency.ManagerClosed` and leaves no loader thread behind.

Every loader here blocks on a ``threading.Event`` the test (or the call under test) sets; a wall-clock
bound appears only as a generous upper bound proving that a timeout fired.
"""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kq import route_shed
from kq_host.residency import LayerReport, ManagerClosed, PreloadError, ResidencyManager

# A timeout must fire within this many seconds of its end, however loaded the machine.
SLACK_S = 2.0


def gated_loader(gates: dict, started: dict | None = None):
    """A loader that blocks each read of ``(layer, expert)`` in ``gates`` until its event is set (10 s at most),
    setting ``started[(layer, expert)]`` when the read begins."""

    def loader(layer, expert, slot):
        if started is not None and (layer, expert) in started:
            started[(layer, expert)].set()
        gate = gates.get((layer, expert))
        if gate is not None:
            gate.wait(10)
        return 1

    return loader


def routed(*experts):
    ids = np.array([experts], np.int64)
    return ids, np.full(ids.shape, 1.0 / ids.size)


def test_acquire_waits_only_for_its_own_layers_reads():
    stuck = threading.Event()
    manager = ResidencyManager(2, 8, 4, loader=gated_loader({(1, 5): stuck}), queue_depth=2, impl="numpy")
    try:
        assert manager.prefetch(1, np.array([[5]]), np.array([[0.9]])) == 1
        table = manager.acquire(0, *routed(2, 3))
        assert table[2] >= 0 and table[3] >= 0
        assert [(read.layer, read.expert) for read in manager.pending()] == [(1, 5)]  # still loading
    finally:
        stuck.set()
        manager.close()


def test_acquire_applies_its_timeout_once():
    stuck = threading.Event()
    manager = ResidencyManager(1, 8, 4, loader=gated_loader({(0, 3): stuck}), queue_depth=2, impl="numpy")
    timeout = 2.5
    try:
        start = time.perf_counter()
        with pytest.raises(PreloadError, match="still out") as raised:
            manager.acquire(0, *routed(3), timeout=timeout)
        assert time.perf_counter() - start < timeout + SLACK_S
        assert [(read.layer, read.expert) for read in raised.value.pending] == [(0, 3)]
    finally:
        stuck.set()
        manager.close()


@pytest.mark.parametrize("queue_depth", [0, 2], ids=["inline-loads", "loader-threads"])
def test_acquire_past_its_timeout_names_a_failed_read_failed_and_only_a_read_still_out_pending(queue_depth):
    stuck = threading.Event()

    def loader(layer, expert, slot):
        if expert == 3:
            raise OSError(5, "Input/output error")
        if expert == 5:
            stuck.wait(10)
        return 1

    manager = ResidencyManager(1, 16, 4, loader=loader, queue_depth=queue_depth, impl="numpy")
    try:
        for count, credit in ((1, True), (2, False)):  # the retry reads expert 3 again
            with pytest.raises(PreloadError, match=r"experts \[3\] failed \(expert 3: OSError: .*Input/output error\)"
                                                   r", the reads of experts \[5\] still out after 0.5 s") as caught:
                manager.acquire(0, *routed(3, 5), timeout=0.5, credit=credit)
            assert [(r.expert, r.error_type, r.count) for r in caught.value.failed] == [(3, "OSError", count)]
            assert [read.expert for read in caught.value.pending] == [read.expert for read in manager.pending()] == [5]
            assert list(manager.failures) == [(0, 3)]
    finally:
        stuck.set()
        manager.close()


def test_a_prefetched_read_that_fails_while_acquire_waits_is_named_failed():
    # the read was started by prefetch, not by acquire: it fails during the wait, beside a read still out
    stuck, fail = threading.Event(), threading.Event()

    def loader(layer, expert, slot):
        if expert == 3:
            fail.wait(10)
            raise OSError(5, "Input/output error")
        stuck.wait(10)
        return 1

    manager = ResidencyManager(1, 16, 4, loader=loader, queue_depth=2, impl="numpy")
    try:
        manager.prefetch(0, *routed(3, 5))
        threading.Timer(0.1, fail.set).start()
        with pytest.raises(PreloadError, match=r"experts \[3\] failed .*, the reads of experts \[5\] still out") as caught:
            manager.acquire(0, *routed(3, 5), timeout=0.5)
        assert [r.expert for r in caught.value.failed] == [3]
        assert [read.expert for read in caught.value.pending] == [5]
    finally:
        fail.set()
        stuck.set()
        manager.close()


def test_a_timeout_longer_than_a_lock_can_wait_waits_as_none():
    """A finite timeout past ``threading.TIMEOUT_MAX`` (1e10 s) waits for the read as no limit does (a wait of
    that length raised OverflowError from the lock)."""
    gate = threading.Event()
    manager = ResidencyManager(1, 8, 4, loader=gated_loader({(0, 3): gate}), queue_depth=2, impl="numpy")
    loaders = list(manager._pool._threads)
    try:
        threading.Timer(0.2, gate.set).start()
        assert manager.acquire(0, *routed(3), timeout=1e10)[3] >= 0
        manager.prefetch(0, *routed(5))
    finally:
        gate.set()
        assert manager.close(timeout=1e10) == []  # close waits for its reads the same way
    for thread in loaders:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in loaders)


@pytest.mark.parametrize("call", ["acquire", "preload"])
def test_a_timeout_holds_with_inline_loads(call):
    """``queue_depth=0`` runs loads on the caller's thread; given a timeout, the load runs where the wait can
    end, is reported out, and publishes once it lands."""
    stuck = threading.Event()
    manager = ResidencyManager(1, 8, 4, loader=gated_loader({(0, 3): stuck}), queue_depth=0, impl="numpy")
    try:
        start = time.perf_counter()
        with pytest.raises(PreloadError, match="still out") as raised:
            if call == "acquire":
                manager.acquire(0, *routed(3), timeout=0.2)
            else:
                manager.preload(0, [3], timeout=0.2)
        assert time.perf_counter() - start < 0.2 + SLACK_S
        assert [(read.layer, read.expert) for read in raised.value.pending] == [(0, 3)]
        stuck.set()
        assert manager.drain() == []
        assert 3 in manager.resident(0)
    finally:
        stuck.set()
        manager.close()


def test_slots_held_by_loading_prefetches_are_a_preload_error_then_freed():
    gate = threading.Event()
    loader = gated_loader({(0, 5): gate, (0, 6): gate})
    manager = ResidencyManager(1, 8, 2, loader=loader, queue_depth=2, impl="numpy")
    try:
        assert manager.prefetch(0, np.array([[5, 6]]), np.array([[0.9, 0.8]])) == 2
        with pytest.raises(PreloadError, match="held by reads still loading") as raised:
            manager.acquire(0, *routed(1), timeout=0.2)
        assert sorted(read.expert for read in raised.value.pending) == [5, 6]
        gate.set()
        table = manager.acquire(0, *routed(1))  # waits for a prefetch to land, then evicts it
        assert table[1] >= 0
    finally:
        gate.set()
        manager.close()


def test_too_few_slots_with_nothing_loading_is_still_a_value_error():
    manager = ResidencyManager(1, 8, 2, loader=lambda *read: 1, queue_depth=2, impl="numpy")
    with pytest.raises(ValueError, match="give the arena more slots"):
        manager.acquire(0, *routed(1, 2, 3), timeout=1)
    manager.close()


def test_preload_waits_only_for_its_own_reads():
    stuck = threading.Event()
    manager = ResidencyManager(2, 8, 4, loader=gated_loader({(1, 5): stuck}), queue_depth=2, impl="numpy")
    try:
        manager.prefetch(1, np.array([[5]]), np.array([[0.9]]))
        manager.preload(0, [1, 2])
        assert sorted(manager.resident(0)) == [1, 2]
        assert [(read.layer, read.expert) for read in manager.pending()] == [(1, 5)]
    finally:
        stuck.set()
        manager.close()


def _wait_in(manager, call: str):
    if call == "acquire":
        manager.acquire(0, *routed(3))
    elif call == "preload":
        manager.preload(0, [3])
    else:
        manager.prefetch(0, np.array([[3]]), np.array([[1.0]]))
        manager.drain()


@pytest.mark.parametrize("call, queue_depth", [("acquire", 1), ("preload", 1), ("drain", 1), ("acquire", 0),
                                               ("preload", 0)])
def test_close_from_another_thread_interrupts_a_wait(call, queue_depth):
    threads_before = set(threading.enumerate())
    stuck, started = threading.Event(), {(0, 3): threading.Event()}
    manager = ResidencyManager(1, 8, 4, loader=gated_loader({(0, 3): stuck}, started), queue_depth=queue_depth,
                               impl="numpy")
    if queue_depth == 0:  # inline: the load runs on the waiting thread, so only a timeout lets close in
        waiting = manager.acquire if call == "acquire" else manager.preload
        args = routed(3) if call == "acquire" else ([3],)
        target = lambda: waiting(0, *args, timeout=30)  # noqa: E731
    else:
        target = lambda: _wait_in(manager, call)  # noqa: E731
    raised = []

    def run():
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - examined below
            raised.append(error)

    waiter = threading.Thread(target=run)
    waiter.start()
    try:
        assert started[(0, 3)].wait(10), "the read never started"
        out = manager.close(timeout=0.2)
        waiter.join(0.2 + SLACK_S)
        assert not waiter.is_alive(), f"{call} still waits after close"
        assert len(raised) == 1 and isinstance(raised[0], ManagerClosed), raised
        assert f"{call}: the manager was closed" in str(raised[0])
        assert [(read.layer, read.expert) for read in out] == [(0, 3)]
        with pytest.raises(ManagerClosed, match="acquire: the manager was closed"):
            manager.acquire(0, *routed(1))
    finally:
        stuck.set()
        waiter.join(10)
    started_since = set(threading.enumerate()) - threads_before - {waiter}
    for thread in started_since:  # the loader threads end once their loads return
        thread.join(10)
    assert not [thread.name for thread in started_since if thread.is_alive()], "a loader thread outlived close"


def test_close_from_inside_the_manager_is_refused_not_a_deadlock():
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: 1, queue_depth=0, impl="numpy")
    refused = []

    def fence():
        try:
            manager.close()
        except RuntimeError as error:
            refused.append(str(error))

    ids, scores = np.array([[1]], np.int32), np.ones((1, 1), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)], fence=fence)
    assert refused and "from inside" in refused[0]
    manager.close()


@pytest.mark.parametrize("timeout", [-1, float("nan"), True, "1", [1.0]])
@pytest.mark.parametrize("call", ["acquire", "preload", "prefetch", "step", "drain", "close"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_by_name(call, timeout):
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: 1, queue_depth=0, impl="numpy")
    ids, scores = np.array([[1]], np.int32), np.ones((1, 1), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    calls = {"acquire": lambda: manager.acquire(0, *routed(1), timeout=timeout),
             "preload": lambda: manager.preload(0, [1], timeout=timeout),
             "prefetch": lambda: manager.prefetch(0, ids, scores, timeout=timeout),
             "step": lambda: manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)], timeout=timeout),
             "drain": lambda: manager.drain(timeout=timeout), "close": lambda: manager.close(timeout=timeout)}
    with pytest.raises(ValueError, match=f"{call}: timeout"):
        calls[call]()
    assert manager.resident(0) == {} and manager.pending() == [] and manager.token == 0
    assert manager.stats()[1].lookups == 0
    manager.close()


@pytest.mark.parametrize("call", ["step", "prefetch"])
def test_step_and_prefetch_bound_their_inline_loads_by_a_timeout(call):
    """With ``queue_depth=0`` the loads of a token boundary or a prefetch run in the call; given a timeout
    they run on a thread of their own, the call returns once it runs out, and they publish once landed."""
    stuck = threading.Event()
    manager = ResidencyManager(1, 8, 4, loader=gated_loader({(0, 3): stuck}), queue_depth=0, impl="numpy")
    try:
        start = time.perf_counter()
        if call == "step":
            ids, scores = np.array([[3]], np.int32), np.ones((1, 1), np.float32)
            shed = route_shed(ids, scores, manager.snapshot()[0])
            manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)], timeout=0.2)
        else:
            assert manager.prefetch(0, np.array([[3]]), np.array([[1.0]]), timeout=0.2) == 1
        assert time.perf_counter() - start < 0.2 + SLACK_S
        assert [(read.layer, read.expert) for read in manager.pending()] == [(0, 3)]
        stuck.set()
        assert manager.drain() == [] and 3 in manager.resident(0)
    finally:
        stuck.set()
        manager.close()


def test_close_while_another_thread_is_busy_in_a_fence_returns_within_its_timeout():
    in_fence, release = threading.Event(), threading.Event()
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: 1, queue_depth=2, impl="numpy")
    ids, scores = np.array([[1]], np.int32), np.ones((1, 1), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    stepped = []

    def fence():
        in_fence.set()
        release.wait(10)

    def run():
        try:
            stepped.append(manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)], fence=fence))
        except BaseException as error:  # noqa: BLE001 - examined below
            stepped.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert in_fence.wait(10)
        start = time.perf_counter()
        assert manager.close(timeout=0.2) == []
        assert time.perf_counter() - start < 0.2 + SLACK_S
    finally:
        release.set()
        worker.join(10)
    assert len(stepped) == 1 and isinstance(stepped[0], ManagerClosed), stepped  # closed under the fence
    with pytest.raises(ManagerClosed, match="step: the manager was closed"):
        manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)])


@pytest.mark.parametrize("queue_depth", [0, 2])
def test_a_step_whose_fence_outlasts_a_close_starts_no_read(queue_depth):
    """close on another thread while a step waits in its fence, past close's timeout: the step raises
    ManagerClosed once its fence returns, and no read starts (none runs, none is left pending)."""
    in_fence, release = threading.Event(), threading.Event()
    reads = []
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: reads.append(read) or 1, queue_depth=queue_depth,
                               impl="numpy")
    ids, scores = np.array([[1, 5]], np.int32), np.ones((1, 2), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    outcome = []

    def fence():
        in_fence.set()
        release.wait(10)

    def run():
        try:
            outcome.append(manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)], fence=fence))
        except BaseException as error:  # noqa: BLE001 - examined below
            outcome.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert in_fence.wait(10)
        assert manager.close(timeout=0.3) == []
    finally:
        release.set()
        worker.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], ManagerClosed), outcome
    assert "step: the manager was closed" in str(outcome[0])
    assert reads == [] and manager.pending() == [] and manager.resident(0) == {}
    assert manager.stats()[1].lookups == 0 and manager.token == 0  # nothing credited: the step did not run


@pytest.mark.parametrize("queue_depth", [0, 2])
def test_a_close_that_returns_while_a_step_places_its_reads_stops_those_reads(queue_depth):
    """close returns (its timeout spent on the busy step) after the step checked the manager open and before
    it submits its reads: the submission is refused with ManagerClosed and no loader runs."""
    reads, closes = [], []
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: reads.append(read) or 1, queue_depth=queue_depth,
                               impl="numpy")
    place = manager._ops.place

    def place_then_close(*args, **kwargs):
        placed = place(*args, **kwargs)
        closer = threading.Thread(target=lambda: closes.append(manager.close(timeout=0.1)))
        closer.start()
        closer.join(10)
        return placed

    manager._ops = SimpleNamespace(credit=manager._ops.credit, place=place_then_close, publish=manager._ops.publish)
    ids, scores = np.array([[1, 5]], np.int32), np.ones((1, 2), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    with pytest.raises(ManagerClosed, match="step: the manager was closed"):
        manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)])
    assert closes == [[]] and reads == [] and manager.pending() == []


@pytest.mark.parametrize("call", ["step", "acquire", "prefetch", "preload", "drain", "next_token"])
def test_every_call_after_close_raises_manager_closed_by_name(call):
    manager = ResidencyManager(1, 8, 4, loader=lambda *read: 1, queue_depth=2, impl="numpy")
    manager.preload(0, [1])
    assert manager.close() == []
    ids, scores = np.array([[2]], np.int32), np.ones((1, 1), np.float32)
    shed = route_shed(ids, scores, manager.snapshot()[0])
    calls = {"step": lambda: manager.step([LayerReport(ids, scores, shed.miss_ids, shed.miss_scores)]),
             "acquire": lambda: manager.acquire(0, *routed(2)), "prefetch": lambda: manager.prefetch(0, ids, scores),
             "preload": lambda: manager.preload(0, [2]), "drain": manager.drain, "next_token": manager.next_token}
    with pytest.raises(ManagerClosed, match=f"ResidencyManager.{call}: the manager was closed"):
        calls[call]()
    assert manager.resident(0) == {1: 0} and manager.token == 0
    assert manager.close() == []  # a second close is harmless
