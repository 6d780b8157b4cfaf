"""The host side of a bounded expert arena: which experts are resident, and the token-boundary step.

A decode engine hands each token's graph a snapshot of ``int32 [L, E]`` slot
tables (``-1`` = not resident) and, at the boundary, calls :meth:`ResidencyManager.step`
with what the graph reported. The step runs in a fixed order that is the
safety fence for slots that a running gather may still read:

1. wait for the finished token's gathers (the caller's ``fence``);
2. credit popularity from the token's routed set;
3. publish reads that have landed: only now does an expert's table entry
   point at its slot (a failed read leaves the slot free and is reported);
4. choose victims and clear their table entries, before any read targets their slots;
5. submit prestage reads for this token's misses in :func:`kq_host.prestage.prestage_order`,
   up to the per-token read budget;
6. snapshot the tables for the next token.

A slot being written is never mapped in any snapshot: its old expert was
cleared in (4) before the read was submitted, and its new expert is published
in (3) only after the read (and the write, if the loader writes) completed.

A read that fails leaves its slot free and its expert unpublished; :attr:`ResidencyManager.failures`
keeps one record per expert (a count and the last error's text), and the expert is not read
again for 2, 4, 8, ... tokens (up to 1024) after each failure in a row. A read fails when the
loader raises, returns an int that is no byte count (negative, or more than :data:`MAX_BYTE_COUNT`), returns
a payload with no arena to write it into, or returns a payload the arena refuses or whose arrays share memory with another payload not yet published
(a staging buffer reused before its expert was written), or when the arena's write raises.
Publishing is all or nothing per read: whatever raises, every slot ends free, loading or
resident for exactly one expert, and the tables point only at resident slots.

Loader threads are daemon threads: a loader that never returns does not keep the process
from exiting after :meth:`ManagerBase.close`.

Every call that waits for reads (:meth:`ResidencyManager.acquire`, :meth:`ResidencyManager.preload`,
:meth:`ManagerBase.drain`, :meth:`ManagerBase.close`) takes a ``timeout`` in seconds, kept as one deadline
for the whole call, and waits only for the reads it needs. With ``queue_depth=0`` loads run on the calling
thread, except in a call given a timeout: its loads run on a thread of their own, so the wait can end.
:meth:`ManagerBase.close` may be called from any thread: a call waiting for reads on another thread
then raises :class:`ManagerClosed`, and so does a call of another thread busy before its reads (a step's
fence), which then starts none.
"""

from __future__ import annotations

import itertools
import math
import mmap
import numbers
import queue
import threading
import time
import weakref
from collections.abc import Mapping as MappingABC
from concurrent.futures import Future
from dataclasses import dataclass, fields
from operator import itemgetter
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from kq_core import reports as report_layout
from kq_core.validate import is_int, is_int_scalar, is_real
from kq_host import bookkeeping
from kq_host.arena import Arena, write_landed
from kq_host.bookkeeping import SlotState, Tables
from kq_host.expert_store import shared_memory_pairs
from kq_host.prestage import int64_ids

# Loader threads a manager may run: reads in flight beyond a few dozen add nothing a disk serves faster.
MAX_QUEUE_DEPTH = 256
Loader = Callable[[int, int, int], Any]  # (layer, expert, slot) -> payload for the arena, or None

__all__ = ["MAX_BACKOFF_DOUBLINGS", "MAX_BYTE_COUNT", "FailedRead", "LayerReport", "LayerStats", "Loader", "ManagerBase",
           "ManagerClosed", "PendingRead", "PreloadError", "ResidencyManager", "SlotState"]

# The largest int a loader may return as the bytes it read.
MAX_BYTE_COUNT = 2**40  # 1 TiB: bytes_read (int64) cannot wrap before 2**23 reads of it
_MAX_READ_BUDGET = 2**62  # read_budget is kept as an int64


@dataclass
class LayerStats:
    """Counters of one layer (or of all layers, summed)."""

    lookups: int = 0  # routed entries with a valid expert id
    hits: int = 0  # of those, served from the arena: not among the token's reported misses (step), resident (acquire)
    misses: int = 0  # valid and reported missed (step) or not resident (acquire)
    shed_count: int = 0  # every shed entry (misses plus out-of-range ids)
    shed_mass: float = 0.0  # sum of the shed entries' scores
    routed_mass: float = 0.0  # sum of all routed scores
    over_budget: int = 0  # tokens in which shed mass exceeded (1 - keep_mass) of routed mass
    reads_submitted: int = 0
    reads_landed: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    evictions: int = 0
    reads_in_flight: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    def add(self, other: "LayerStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, earlier: "LayerStats") -> "LayerStats":
        """The counts accumulated after ``earlier`` was taken (e.g. one token's)."""
        return LayerStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


@dataclass
class FailedRead:
    """The failures of one expert's reads: how many, and the last one (as text: no exception object,
    so no traceback keeps a loader's frames and buffers alive)."""

    layer: int
    expert: int
    slot: int  # the slot the last failed read targeted
    count: int
    error_type: str
    message: str
    token: int  # the token at whose boundary the last failure was seen


@dataclass(frozen=True)
class PendingRead:
    """A read submitted and not yet published."""

    layer: int
    expert: int
    slot: int


# A read that failed n times in a row is not submitted again for 2**min(n, MAX_BACKOFF_DOUBLINGS) tokens.
MAX_BACKOFF_DOUBLINGS = 10


def _described(failed: Sequence[FailedRead], *, layers: bool = False) -> str:
    """The first three failed reads, ``expert E: Error: message`` (``layer L`` first with ``layers``), and how
    many more: the one wording of every error that lists failed reads."""
    shown = "; ".join(f"{f'layer {r.layer} ' if layers else ''}expert {r.expert}: {r.error_type}: {r.message}"
                      for r in failed[:3])
    return shown + (f"; {len(failed) - 3} more" if len(failed) > 3 else "")


class PreloadError(RuntimeError):
    """:meth:`ResidencyManager.preload` could not publish every expert it was given.

    Attributes:
        failed: the :class:`FailedRead` records of the reads that failed (their slots are free again).
        pending: the reads still out when the timeout ran out (they publish at a later step).
    """

    def __init__(self, message: str, failed: list[FailedRead], pending: list[PendingRead]):
        super().__init__(message)
        self.failed, self.pending = failed, pending


class ManagerClosed(RuntimeError):
    """A call reached a closed manager, or was waiting for reads when :meth:`ManagerBase.close` ran on
    another thread (the reads it started stay pending; the manager starts no further read)."""


def deadline_of(method: str, timeout) -> float | None:
    """The ``time.monotonic()`` at which ``timeout`` seconds from now run out (None: no limit).

    Raises:
        ValueError: ``timeout`` is not None nor a number of seconds >= 0 (``inf`` is no limit).
    """
    if timeout is None:
        return None
    if not is_real(timeout) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{method}: timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return None if math.isinf(timeout) else time.monotonic() + float(timeout)


def _lock_timeout(deadline: float | None) -> float:
    """A lock's or condition's wait until ``deadline`` (:func:`deadline_of`): -1 (no limit) for None, at most
    ``threading.TIMEOUT_MAX`` (a longer one raises OverflowError there), never below 0."""
    if deadline is None:
        return -1
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def describe_error(error: BaseException) -> str:
    """``str(error)``, or a stand-in when the exception's own ``__str__`` raises."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not break the bookkeeping
        return f"<{type(error).__name__} whose message could not be formed>"


class _DaemonPool:
    """A few daemon threads running submitted calls in order of submission.

    Unlike ``ThreadPoolExecutor``'s workers, they are not joined at interpreter exit, so a call
    that never returns (a loader stuck on a dead disk) does not keep the process alive.
    """

    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # those started
        try:
            for i in range(workers):
                thread = threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:  # the threads started stop
            self.shutdown()
            raise

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

    @staticmethod
    def run_detached(fn: Callable, *args) -> Future:
        """Runs ``fn(*args)`` on a daemon thread of its own; the future holds its result or exception."""
        future: Future = Future()
        future.set_running_or_notify_cancel()

        def work() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

        threading.Thread(target=work, name="kq-inline-read", daemon=True).start()
        return future

    def shutdown(self, wait_seconds: float = 0.0) -> None:
        """Cancels the calls not started and stops the threads (waiting up to ``wait_seconds`` for each)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():  # a manager may be dropped on its own loader thread
                thread.join(wait_seconds)


_second = itemgetter(1)


class _ReadBatch:
    """The reads one step (or one preload) submits, in order. Inline, the caller runs them at once;
    with a pool, up to ``queue_depth`` workers each take the next unclaimed read until none is left, so
    a token's reads cost a few task submissions, not one each, and still start best first. Outcomes are
    kept by position: a payload, or the exception the read raised (``failed``)."""

    def __init__(self, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray):
        self.layers, self.experts, self.slots = layers, experts, slots
        self.size = self.open_count = layers.size  # open: not yet published
        self._reads = (layers.tolist(), experts.tolist(), slots.tolist())  # what the loader is called with
        self.outcomes: list[Any] = [None] * self.size
        # Written by the workers byte by byte, read by the publisher as bool arrays (views, no copy).
        self._failed, self._done = bytearray(self.size), bytearray(self.size)
        self.failed = np.frombuffer(self._failed, bool)
        self.done = np.frombuffer(self._done, bool)
        self.open = np.ones(self.size, bool)
        self.futures: list[Future] = []
        self._claims = itertools.count()  # next() on it is atomic in CPython: each read is claimed once

    def done_count(self) -> int:
        return self._done.count(1)

    def all_done(self, positions: np.ndarray | None = None) -> bool:
        """Whether every read (or every read at ``positions``) is done."""
        return self._done.count(1) == self.size if positions is None else bool(self.done[positions].all())

    def run_inline(self, loader: Loader, cancelled: Callable[[], bool]) -> None:
        """Runs every read in order on the calling thread, the only one running this batch, until none is left or
        ``cancelled()`` (a C function, e.g. a lock's ``locked``) is true before a read. The loader is called
        from C (``map``), with no Python frame of the manager's per read; a read that raises is recorded as
        failed and the reads after it go on."""
        layers, experts, slots = self._reads
        outcomes, count, start = self.outcomes, self.size, 0
        while start < count:
            # Each read's layer comes through a C iterator that ends once cancelled() holds.
            allowed = map(_second, zip(iter(cancelled, True), layers[start:] if start else layers))
            got: list = []
            try:
                got.extend(map(loader, allowed, experts[start:] if start else experts,
                               slots[start:] if start else slots))
            except BaseException as error:  # noqa: BLE001 - a failed read; published as one in (3)
                # list.extend keeps what it took before the loader raised: the reads before this one.
                at = start + len(got)
                outcomes[start:at] = got
                outcomes[at], self._failed[at] = error, 1
                start = at + 1
                continue
            outcomes[start:start + len(got)] = got
            start += len(got)
            break  # every read ran, or the batch was cancelled
        self._done[:start] = b"\x01" * start

    def run(self, loader: Loader, cancelled: threading.Event, landed: Callable[[], None] | None = None) -> None:
        """Claims and runs reads until none is left (or ``cancelled`` is set), calling ``landed`` after each."""
        layers, experts, slots = self._reads
        outcomes, failed, done, count = self.outcomes, self._failed, self._done, len(layers)
        for index in self._claims:
            if index >= count or cancelled.is_set():
                return
            try:
                outcomes[index] = loader(layers[index], experts[index], slots[index])
            except BaseException as error:  # noqa: BLE001 - a failed read; published as one in (3)
                outcomes[index] = error
                failed[index] = 1
            done[index] = 1
            if landed is not None:
                landed()


@dataclass
class LayerReport:
    """What the host reads back from one layer's graph for one token (NumPy arrays).

    Attributes:
        indices: ``[T, K]`` routed ids; scores: ``[T, K]`` routed scores;
        miss_ids / miss_scores: ``route_shed``'s miss lists ``[T, K]``;
        served: ``[T, K]`` each entry's score where its expert (or a stand-in) was computed, 0 where shed;
            None where the graph did not report it.
    """

    indices: np.ndarray
    scores: np.ndarray
    miss_ids: np.ndarray
    miss_scores: np.ndarray
    served: np.ndarray | None = None

    @classmethod
    def from_packed(cls, packed: np.ndarray) -> "LayerReport":
        """The stacked report (``[L, T, K]`` arrays) from the packed layout of :mod:`kq_core.reports`, int32
        ``[5, L, T, K]``, which every decode step builds in its graph so a token's reports come back in one
        transfer.

        Raises:
            ValueError: ``packed`` is not that layout.
        """
        try:
            unpacked = report_layout.unpack(packed)
        except ValueError as error:
            raise ValueError(f"LayerReport.from_packed: {error}") from None
        return cls(*(unpacked[name] for name in report_layout.REPORT_FIELDS))

    @classmethod
    def stacked(cls, layers: Sequence["LayerReport"]) -> "LayerReport":
        """One report of ``[L, T, K]`` arrays from one report per layer (what :meth:`ResidencyManager.step`
        takes in one piece).

        Raises:
            ValueError: no layer's report is given.
        """
        layers = list(layers)
        if not layers:
            raise ValueError("LayerReport.stacked: layers must hold one report per layer, got none")
        return cls(*(None if any(getattr(r, f.name) is None for r in layers)
                     else np.stack([getattr(r, f.name) for r in layers]) for f in fields(cls)))


_COUNTERS = tuple(f.name for f in fields(LayerStats))


class _Exclusive:
    """``with _Exclusive(manager, method):`` holds the manager's ``_busy`` lock, refusing a second thread
    instead of waiting, and records the holding thread in ``_busy_owner``."""

    __slots__ = ("manager", "method")

    def __init__(self, manager: "ManagerBase", method: str):
        self.manager, self.method = manager, method

    def __enter__(self) -> None:
        if not self.manager._busy.acquire(blocking=False):
            raise RuntimeError(f"ResidencyManager.{self.method}: called from two threads at once; a manager serves "
                               f"one decode thread (call it from that thread, or give each thread its own manager)")
        self.manager._busy_owner = threading.get_ident()

    def __exit__(self, *exc) -> None:
        self.manager._busy_owner = None
        self.manager._busy.release()


class ManagerBase:
    """What every residency manager shares: its arguments, checked; the read queue and its
    lifecycle (``pending``, ``drain``, ``close``); waiting for reads; the one-thread guard.

    A subclass builds its tables after ``__init__`` (``pinned_experts`` holds the checked
    pinned sets), sets ``_snapshot``, keeps its reads in flight in ``_pending`` as it likes, calls
    ``_notify_landed()`` when a read finishes on a loader thread (as :class:`ResidencyManager`'s loader
    threads do), and defines ``snapshot()``,
    ``pending()``, ``_all_landed()`` and ``_publish_landed()`` (publishes the reads done now).
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *, loader: Loader,
                 arena: Arena | None, policy: str, pinned: Mapping[int, Iterable[int]] | None, keep_mass: float,
                 read_budget: int | None, decay_interval: int, queue_depth: int, bytes_per_expert: int):
        for name, value, minimum, maximum in (
                ("num_layers", num_layers, 1, None), ("num_experts", num_experts, 1, None),
                ("num_slots", num_slots, 1, None), ("queue_depth", queue_depth, 0, None),
                ("decay_interval", decay_interval, 0, None), ("bytes_per_expert", bytes_per_expert, 0, MAX_BYTE_COUNT),
                ("read_budget", 0 if read_budget is None else read_budget, 0, _MAX_READ_BUDGET)):
            if not is_int_scalar(value) or value < minimum or (maximum is not None and value > maximum):
                raise ValueError(f"ResidencyManager: {name} must be an int >= {minimum}"
                                 f"{'' if maximum is None else f' and <= {maximum}'}, got {value!r}")
        num_layers, num_experts, num_slots, queue_depth, decay_interval, bytes_per_expert = (
            int(n) for n in (num_layers, num_experts, num_slots, queue_depth, decay_interval, bytes_per_expert))
        read_budget = None if read_budget is None else int(read_budget)
        if queue_depth > MAX_QUEUE_DEPTH:
            raise ValueError(f"ResidencyManager: queue_depth must be at most {MAX_QUEUE_DEPTH} (a loader thread "
                             f"each), got {queue_depth}")
        if policy not in ("lfu", "lru"):
            raise ValueError(f"ResidencyManager: policy must be 'lfu' or 'lru', got {policy!r}")
        shape = getattr(arena, "shape", None)
        if shape is not None and tuple(shape) != (num_layers, num_slots):
            raise ValueError(f"ResidencyManager: the arena holds {shape[0]} layers of {shape[1]} slots; the manager "
                             f"has {num_layers} layers of {num_slots} slots")
        if (isinstance(keep_mass, (str, bytes, bool, np.bool_)) or np.ndim(keep_mass) != 0
                or np.asarray(keep_mass).dtype.kind not in "fiu" or not 0.0 <= float(keep_mass) <= 1.0):
            raise ValueError(f"ResidencyManager: keep_mass must be a number in [0, 1], got {keep_mass!r}")
        keep_mass = float(keep_mass)
        if pinned is not None and not isinstance(pinned, Mapping):
            raise ValueError(f"ResidencyManager: pinned must map layers to expert ids, got {type(pinned).__name__}")
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.loader, self.arena, self.policy = loader, arena, policy
        self.keep_mass, self.read_budget, self.decay_interval = keep_mass, read_budget, decay_interval
        self.bytes_per_expert, self.queue_depth = bytes_per_expert, queue_depth
        self.pinned_experts: dict[int, set[int]] = {}
        for layer, experts in (pinned or {}).items():
            experts = list(experts) if isinstance(experts, Iterable) else [experts]
            if (not is_int_scalar(layer) or not 0 <= layer < num_layers
                    or any(not is_int_scalar(e) or not 0 <= e < num_experts for e in experts)):
                raise ValueError(f"ResidencyManager: pinned maps layers in [0, {num_layers}) to expert ids in "
                                 f"[0, {num_experts}), got layer {layer}: {experts}")
            experts = {int(e) for e in experts}
            if len(experts) > num_slots:
                raise ValueError(f"ResidencyManager: layer {layer} pins {len(experts)} experts into {num_slots} slots")
            self.pinned_experts[int(layer)] = experts
        self._pool = _DaemonPool(queue_depth, "kq-prestage") if queue_depth else None
        if self._pool is not None:  # a manager dropped without close() stops its loader threads
            weakref.finalize(self, self._pool.shutdown)
        self._pending: list = []
        self._cancelled = threading.Event()  # set by close: pooled workers start no further read
        self._cancel_lock = threading.Lock()  # taken by close, never released: inline loads start no further read
        self._landed = threading.Condition()  # notified when a read finishes, and by close
        self._closed = False
        self.failures: dict[tuple[int, int], FailedRead] = {}
        self._busy = threading.Lock()
        self._busy_owner: int | None = None  # the thread inside step, acquire, preload, ... (None: none)
        self.token = 0

    def _checked_layer(self, method: str, layer) -> int:
        """``layer`` as an int, or ValueError naming it unless it is an int in ``[0, num_layers)``."""
        if not is_int_scalar(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{method}: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _preload_experts(self, layer: int, experts: Iterable[int]) -> tuple[int, list[int]]:
        """``preload``'s arguments, checked: the layer and the expert ids as ints."""
        layer = self._checked_layer("preload", layer)
        experts = list(experts)
        bad = [e for e in experts if not is_int_scalar(e) or not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"preload: experts must be int ids in [0, {self.num_experts}), got {bad}")
        return layer, [int(e) for e in experts]

    def _exclusive(self, method: str) -> "_Exclusive":
        return _Exclusive(self, method)

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise ManagerClosed(f"{type(self).__name__}.{method}: the manager was closed; it starts no read "
                                f"(make a new manager to decode again)")

    def _closed_meanwhile(self, method: str) -> ManagerClosed:
        """The error of a call that finds the manager closed by another thread while it ran."""
        return ManagerClosed(f"{type(self).__name__}.{method}: the manager was closed while this call ran (close ran "
                             f"on another thread); it starts no further read")

    def _notify_landed(self) -> None:
        """Wakes every call waiting for reads: a read finished on a loader thread."""
        with self._landed:
            self._landed.notify_all()

    def _wait(self, method: str, ready: Callable[[], bool], deadline: float | None, *,
              interruptible: bool = True) -> bool:
        """Waits until ``ready()`` (checked whenever a read finishes) or ``deadline`` passes.

        Returns:
            Whether ``ready()`` held.

        Raises:
            ManagerClosed: ``interruptible`` and the manager was closed (by another thread) meanwhile.
        """
        with self._landed:
            while True:
                if interruptible and self._closed:
                    raise ManagerClosed(f"{type(self).__name__}.{method}: the manager was closed while this call "
                                        f"waited for reads (close ran on another thread); its reads stay pending")
                if ready():
                    return True
                if deadline is not None and deadline <= time.monotonic():
                    return False
                self._landed.wait(None if deadline is None else _lock_timeout(deadline))

    def drain(self, timeout: float | None = None) -> list[PendingRead]:
        """Waits up to ``timeout`` seconds (None: no limit) for the reads in flight and publishes those done.

        Returns:
            The reads still out (they stay pending and publish at a later step or drain).

        Raises:
            ValueError: ``timeout`` is no number of seconds >= 0.
            ManagerClosed: the manager was closed (before, or by another thread while this call waited).
            RuntimeError: another thread is inside the manager.
        """
        deadline = deadline_of("drain", timeout)
        self._check_open("drain")
        with self._exclusive("drain"):
            self._wait("drain", self._all_landed, deadline)
            self._publish_landed()
            self._snapshot = self.snapshot()
            return self.pending()

    def close(self, timeout: float | None = 30.0) -> list[PendingRead]:
        """Publishes what lands within ``timeout`` seconds, then stops the loader threads.

        Callable from any thread: a call of another thread waiting for reads (``acquire``, ``preload``,
        ``drain``) raises :class:`ManagerClosed` at once; one busy otherwise (a fence, a load running
        inline) is waited for within the same ``timeout``, and past it nothing is published; that call starts
        no further read and raises :class:`ManagerClosed`. Reads not started are cancelled; a loader still running is left to finish on its own thread (Python cannot
        stop it), and its result is dropped; its thread ends when the loader returns. A second close
        returns the reads out.

        Returns:
            The reads that were still out.

        Raises:
            ValueError: ``timeout`` is no number of seconds >= 0.
            RuntimeError: called from inside the manager's own call (a fence or an inline loader).
        """
        deadline = deadline_of("close", timeout)
        if self._busy_owner == threading.get_ident():
            raise RuntimeError(f"{type(self).__name__}.close: called from inside the manager's own call (a fence or "
                               f"a loader running inline); close it once that call has returned")
        with self._landed:
            closed_before, self._closed = self._closed, True
            self._landed.notify_all()  # a wait of another thread ends with ManagerClosed
        if closed_before:
            return self.pending()
        entered = self._busy.acquire(timeout=_lock_timeout(deadline))
        try:
            if entered:
                self._wait("close", self._all_landed, deadline, interruptible=False)
                self._publish_landed()
                self._snapshot = self.snapshot()
            out = self.pending()
        finally:
            self._cancel_lock.acquire(blocking=False)
            self._cancelled.set()
            if self._pool is not None:
                self._pool.shutdown(wait_seconds=0.0 if not entered or self._pending else 1.0)
            if entered:
                self._busy.release()
        return out

    def raise_failures(self, caller: str) -> None:
        """Ends a run that must not go on past a failed read: raises if any expert's last read failed.

        A lossy decode sheds an expert whose read failed and tries it again a few tokens later; a run whose
        figures or text should not silently carry that (a study, a command's output) calls this after each
        step (every failure stays in :attr:`failures` until the expert's next read lands, at least two steps).

        Args:
            caller: the run's name, first in the message.

        Raises:
            PreloadError: naming up to three failed reads, their errors, and how many failed in all.
        """
        if not self.failures:
            return
        failed = list(self.failures.values())
        raise PreloadError(f"{caller}: {len(failed)} read(s) failed ({_described(failed, layers=True)})", failed, [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# What a loader's return value is (:meth:`ResidencyManager._settled`), decided once per type in a batch.
_NOTHING, _COUNT, _PAYLOAD, _FAILED = 0, 1, 2, 3
_ONLY_INTS, _ONLY_NONE = {int}, {type(None)}


def _outcome_kind(kind: type) -> int:
    """A return value of type ``kind``: a byte count (an int or NumPy integer, as :func:`is_int` takes), nothing
    to write (None, or another integral: a bool), or a payload for the arena (anything else)."""
    if kind is type(None):
        return _NOTHING
    try:
        if issubclass(kind, (int, np.integer)) and not issubclass(kind, bool):
            return _COUNT
        return _NOTHING if issubclass(kind, numbers.Integral) else _PAYLOAD
    except Exception:  # noqa: BLE001 - a type that cannot say what it is: a payload, which the arena refuses
        return _PAYLOAD


def _refuse_shared_buffers(picked: list, failed: np.ndarray, carried: np.ndarray) -> None:
    """Fails every landed read whose payload (where ``carried``) shares memory with another payload's array, or
    another projection of its own (a staging buffer or payload dict reused before its expert was written)."""
    owners, arrays = [], []  # the read each array came from, and the array
    for j in np.flatnonzero(carried & ~failed).tolist():
        payload = picked[j]
        if type(payload) is dict or isinstance(payload, MappingABC):
            for value in payload.values():
                owners.append(j)
                arrays.append(value)
    maybe = _maybe_shared(arrays)
    pairs = shared_memory_pairs([arrays[i] for i in maybe]) if len(maybe) > 1 else []
    shared = {owners[maybe[index]] for pair in pairs for index in pair}
    for j in shared:
        failed[j], picked[j] = True, ValueError(
            "the payload's arrays share memory with another payload not yet published (or with each other): "
            "a loader or host_allocator must hand each read buffers of its own until the step that publishes it")


# Objects whose memory no other object of these types holds: arrays backed by distinct ones cannot overlap.
_OWNERS_OF_MEMORY = (bytes, bytearray, mmap.mmap)


def _maybe_shared(arrays: list) -> list[int]:
    """The positions of the NumPy arrays among ``arrays`` that may share memory with another of them: those backed
    by the same allocation as another (a NumPy array owning its data, or a bytes, bytearray or mmap object); every
    non-empty one where any is backed by something else (whose memory another object may also expose), for
    :func:`~kq_host.expert_store.shared_memory_pairs` to compare. Arrays of other frameworks are left out, as it
    leaves them out."""
    positions, owners = [], []  # the arrays compared, and what backs each (its identity)
    for index, value in enumerate(arrays):
        if not isinstance(value, np.ndarray) or not value.size:
            continue
        owner = value
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        if not (owner.flags.owndata if isinstance(owner, np.ndarray) else type(owner) in _OWNERS_OF_MEMORY):
            return [index for index, value in enumerate(arrays) if isinstance(value, np.ndarray) and value.size]
        positions.append(index)
        owners.append(id(owner))
    if len(owners) < 2:
        return []
    owners = np.array(owners, np.uint64)
    _, first, counts = np.unique(owners, return_inverse=True, return_counts=True)
    return np.array(positions)[counts[first] > 1].tolist()


def _bookkeeping(impl: str):
    """The module that keeps a manager's tables for ``impl`` (NumPy, or the same compiled by Numba)."""
    if impl not in ("auto", "numpy", "numba"):
        raise ValueError(f"ResidencyManager: impl must be 'auto', 'numpy' or 'numba', got {impl!r}")
    if impl == "numpy":
        return bookkeeping
    try:
        from kq_host import bookkeeping_numba
    except ImportError as error:  # Numba missing, or refusing this NumPy
        if impl == "numba":
            raise ImportError(f"ResidencyManager: impl='numba' needs Numba (pip install 'kq[host]'): {error}") from error
        return bookkeeping
    return bookkeeping_numba


class ResidencyManager(ManagerBase):
    """Per-layer slot tables, eviction policy, prestage reads and statistics.

    The state of all layers lives in ``[L, E]`` and ``[L, S]`` arrays
    (:class:`kq_host.bookkeeping.Tables`); each token's bookkeeping works over the
    routed entries, the missed experts and their layers (:mod:`kq_host.bookkeeping`,
    or the same compiled: ``impl``), and its reads go out as one batch.

    Args:
        num_layers, num_experts, num_slots: L, E and S (slots per layer).
        loader: ``loader(layer, expert, slot)`` run on a worker thread; it reads
            the expert (e.g. ``ExpertStore.read_expert``) and either writes it
            into the slot itself and returns None, or returns a payload that
            ``arena.write_slot`` writes at publish time on the caller's thread
            (JAX and MLX arenas). An exception marks the read failed.
        arena: the :class:`Arena` a payload-returning loader's payloads are written into (a payload with no
            arena fails its read); a loader that writes the arena itself may pass it too, for the shape
            check: a read that returns None or a byte count is not written again.
        policy: ``"lfu"`` (default; popularity credited from each token's
            routed set, halved every ``decay_interval`` tokens) or ``"lru"``.
        pinned: ``{layer: expert ids}`` never evicted (load them with :meth:`preload`).
        keep_mass: the shed-mass budget; a layer whose shed mass in a token
            exceeds ``1 - keep_mass`` of its routed mass is counted in ``over_budget``.
        read_budget: reads submitted per token, over all layers (None: no limit).
        queue_depth: concurrent loader threads, at most :data:`MAX_QUEUE_DEPTH`; 0 runs loads inline
            (deterministic tests).
        bytes_per_expert: added to ``bytes_read`` per landed read when the loader
            returns no byte count (an int return value is taken as bytes read).
        impl: who keeps the tables: ``"numpy"`` (array operations), ``"numba"`` (the
            same decisions compiled; needs Numba, ``pip install 'kq[host]'``) or ``"auto"``
            (Numba when it imports, else NumPy). :attr:`impl` says which one runs.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *, loader: Loader,
                 arena: Arena | None = None, policy: Literal["lfu", "lru"] = "lfu",
                 pinned: Mapping[int, Iterable[int]] | None = None, keep_mass: float = 0.9,
                 read_budget: int | None = None, decay_interval: int = 64, queue_depth: int = 8,
                 bytes_per_expert: int = 0, impl: Literal["auto", "numpy", "numba"] = "auto"):
        self._ops = _bookkeeping(impl)  # checked before the base class starts a thread pool
        super().__init__(num_layers, num_experts, num_slots, loader=loader, arena=arena, policy=policy,
                         pinned=pinned, keep_mass=keep_mass, read_budget=read_budget, decay_interval=decay_interval,
                         queue_depth=queue_depth, bytes_per_expert=bytes_per_expert)
        self.impl = "numpy" if self._ops is bookkeeping else "numba"
        self._tables = Tables.empty(num_layers, num_experts, num_slots, policy, _COUNTERS)
        for layer, experts in self.pinned_experts.items():
            self._tables.pinned[layer, sorted(experts)] = True
        self._snapshot = self.snapshot()
        self._lookahead = {name: np.zeros(num_layers, np.float64 if name.endswith("_s") else np.int64)
                           for name in ("critical_reads", "critical_wait_s", "prefetches", "prefetch_used",
                                        "prefetch_late", "prefetch_wasted")}
        self._unused_prefetches: dict[tuple[int, int], bool] = {}
        self._backed_off = False  # whether any read has failed, so that retry_after may hold a token

    # ---- tables -------------------------------------------------------------------------

    def snapshot(self) -> np.ndarray:
        """A copy of every layer's table, ``int32 [L, E]``: what the next graph may use."""
        return self._tables.table.copy()

    def resident(self, layer: int) -> dict[int, int]:
        """``{expert: slot}`` published in ``layer``."""
        table = self._tables.table[self._checked_layer("resident", layer)]
        return {int(e): int(table[e]) for e in np.flatnonzero(table >= 0)}

    def slot_owner(self, layer: int) -> np.ndarray:
        """``int32 [S]``: the expert resident in or loading into each slot, -1 free."""
        return self._tables.owner[self._checked_layer("slot_owner", layer)].copy()

    # ---- loading ------------------------------------------------------------------------

    def _start_reads(self, method: str, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray, *,
                     detached: bool = False) -> _ReadBatch:
        """Starts the reads of claimed slots, in order: on the pool, or inline without one (on a thread of
        their own if ``detached``, so that a caller's timeout can end its wait).

        Raises:
            ManagerClosed: :meth:`close` ran on another thread meanwhile: no read of the batch starts (its
                slots stay claimed: the manager serves no further call), or, inline, the reads after the
                one running when close returned do not (they stay pending).
        """
        batch = _ReadBatch(layers, experts, slots)
        with self._landed:  # close marks the manager closed holding it: a read goes out before, or never
            if self._closed:
                raise self._closed_meanwhile(method)
            self._pending.append(batch)
            if self._pool is not None:
                batch.futures = [self._pool.submit(batch.run, self.loader, self._cancelled, self._notify_landed)
                                 for _ in range(min(self.queue_depth, layers.size))]
        if self._pool is None and detached:
            batch.futures = [_DaemonPool.run_detached(batch.run, self.loader, self._cancelled, self._notify_landed)]
        elif self._pool is None:
            batch.run_inline(self.loader, self._cancel_lock.locked)
            if not batch.all_done():
                raise self._closed_meanwhile(method)
        return batch

    def pending(self) -> list[PendingRead]:
        """The reads submitted and not yet published."""
        out = []
        for batch in list(self._pending):
            still_open = batch.open.copy()  # one look, should another thread be publishing
            out.extend(PendingRead(int(layer), int(expert), int(slot)) for layer, expert, slot in
                       zip(batch.layers[still_open], batch.experts[still_open], batch.slots[still_open]))
        return out

    def _all_landed(self) -> bool:
        return all(batch.all_done() for batch in self._pending)

    def _wait_for_detached(self, batch: _ReadBatch | None, method: str, deadline: float | None) -> None:
        """Without loader threads, waits until ``deadline`` for the loads of ``batch`` that a timeout moved off the
        calling thread (what running them inline would have waited for); with loader threads, nothing."""
        if batch is not None and self._pool is None and batch.futures:
            self._wait(method, batch.all_done, deadline)

    def _open_reads(self, layer: int, experts: np.ndarray | None = None) -> list[tuple[_ReadBatch, np.ndarray]]:
        """The reads of ``layer`` (of ``experts`` only, if given) not yet published: ``(batch, positions)``."""
        out = []
        if experts is not None:
            chosen = np.zeros(self.num_experts, bool)
            chosen[experts] = True
        for batch in self._pending:
            mask = batch.open & (batch.layers == layer)
            if experts is not None:
                mask &= chosen[batch.experts]
            positions = np.flatnonzero(mask)
            if positions.size:
                out.append((batch, positions))
        return out

    def _publish_landed(self) -> None:
        """Publishes the reads done now.

        Each batch's landed reads are settled first (byte counts, shared buffers, the arena's
        write), with every error caught and made that read's failure; only then are the reads
        closed and the tables changed, so no exception leaves a slot loading for a read that is gone.
        """
        interrupt = None
        for batch in self._pending:
            if batch.open_count == batch.size and batch.done_count() == batch.size:  # all of it: no picking
                ready = None
                picked, failed = batch.outcomes, batch.failed.copy()  # the list itself: replaced when closed
                layers, experts, slots = batch.layers, batch.experts, batch.slots
            else:
                ready = np.flatnonzero(batch.done & batch.open)
                if ready.size == 0:
                    continue
                picked = list(map(batch.outcomes.__getitem__, ready.tolist()))  # payloads, or the reads' exceptions
                failed = batch.failed[ready]
                layers, experts, slots = batch.layers[ready], batch.experts[ready], batch.slots[ready]
            nbytes, carried = self._settled(picked, failed)
            if carried is not None:  # payloads to write
                if self.arena is None:
                    for j in np.flatnonzero(carried).tolist():
                        failed[j], picked[j] = True, ValueError(
                            f"the loader returned a {type(picked[j]).__name__} to write, and the manager has no "
                            f"arena to write it into: pass arena=, or have the loader write the expert and "
                            f"return None or its byte count")
                else:
                    _refuse_shared_buffers(picked, failed, carried)
                    self._write(layers, slots, picked, failed, carried & ~failed)
            # Settled: close the reads, then the bookkeeping (neither raises).
            if ready is None:
                batch.open[:] = False
                batch.outcomes = [None] * batch.size
            else:
                batch.open[ready] = False
                outcomes = batch.outcomes
                for i in ready.tolist():
                    outcomes[i] = None  # no payload kept alive past its publishing
            batch.open_count -= layers.size
            # The tables point at the slots now (retry_after is all 0 until a read first fails: not written).
            self._ops.publish(self._tables, layers, experts, slots, failed, nbytes, backing_off=self._backed_off)
            if failed.any():
                for j in np.flatnonzero(failed).tolist():
                    error = picked[j]
                    self._record_failure(PendingRead(int(layers[j]), int(experts[j]), int(slots[j])), error)
                    if isinstance(error, (KeyboardInterrupt, SystemExit)) and interrupt is None:
                        interrupt = error
            if self.failures and not failed.all():
                self._clear_failures(layers[~failed], experts[~failed])
        self._pending = [batch for batch in self._pending if batch.open_count]
        if interrupt is not None:  # after the bookkeeping, so no later step sees this read again
            raise interrupt

    def _clear_failures(self, layers: np.ndarray, experts: np.ndarray) -> None:
        """Drops the failure records of the experts whose reads landed (int64 ``[R]`` each)."""
        keys = np.array(list(self.failures), np.int64).reshape(-1, 2)
        landed = np.isin(keys[:, 0] * self.num_experts + keys[:, 1], layers * self.num_experts + experts)
        for key in keys[landed].tolist():
            del self.failures[tuple(key)]

    def _settled(self, picked: list, failed: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """What each landed read returned, decided per batch: its bytes, and whether it is a payload to write.

        The types of the outcomes are looked at once each: a batch of ints, or of Nones (the loader wrote the
        expert itself), takes no Python per read. An int is the bytes read; None or another integral
        (a bool) counts ``bytes_per_expert``; anything else is a payload for the arena.

        Args:
            picked: ``[R]`` the reads' outcomes (a failed read's exception); an int outside
                ``[0, MAX_BYTE_COUNT]`` is replaced by the error that fails its read.
            failed: bool ``[R]`` the reads failed; set where a byte count is out of range.

        Returns:
            (int64 ``[R]`` the bytes each read counts, bool ``[R]`` the payloads to write or None where none is).
        """
        kinds = set(map(type, picked))
        if kinds == _ONLY_INTS:  # every read returned its byte count: the common case
            try:
                counts = np.array(picked, np.int64)
            except OverflowError:  # an int past int64: no byte count (below)
                counts = None
            if counts is not None and counts.min() >= 0 and counts.max() <= MAX_BYTE_COUNT:
                return counts, None
        elif kinds == _ONLY_NONE:  # every loader wrote its expert
            return np.full(len(picked), self.bytes_per_expert, np.int64), None
        kind_of = {kind: _outcome_kind(kind) for kind in kinds}
        if len(kind_of) == 1:
            outcome_kinds = np.full(len(picked), kind_of.popitem()[1], np.int8)
        else:
            outcome_kinds = np.fromiter(map(kind_of.__getitem__, map(type, picked)), np.int8, len(picked))
        outcome_kinds[failed] = _FAILED
        counts = np.full(len(picked), self.bytes_per_expert, np.int64)
        at = np.flatnonzero(outcome_kinds == _COUNT)
        if at.size:
            values = np.empty(at.size, object)
            values[:] = list(map(picked.__getitem__, at.tolist()))
            fits = ((values >= 0) & (values <= MAX_BYTE_COUNT)).astype(bool)
            counts[at[fits]] = values[fits].astype(np.int64)
            for j in at[~fits].tolist():
                failed[j], picked[j], counts[j] = True, ValueError(
                    f"the loader returned {picked[j]} as the bytes it read; a byte count is an int in "
                    f"[0, {MAX_BYTE_COUNT}]"), 0
        carried = outcome_kinds == _PAYLOAD
        return counts, carried if carried.any() else None

    def _write(self, layers: np.ndarray, slots: np.ndarray, picked: list, failed: np.ndarray,
               payloads: np.ndarray) -> None:
        """Writes the landed payloads (where ``payloads``) into the arena; a refused or raising write makes its
        read failed."""
        written = np.flatnonzero(payloads)
        try:
            refused = write_landed(self.arena, layers[written], slots[written], [picked[j] for j in written.tolist()])
            if len(refused) != written.size:
                raise RuntimeError(f"the arena's write_slots returned {len(refused)} outcomes for "
                                   f"{written.size} writes")
        except BaseException as error:  # noqa: BLE001 - the whole write failed: none of its slots is published
            refused = [error] * written.size
        for j, error in zip(written.tolist(), refused):
            if error is not None:
                failed[j], picked[j] = True, error

    def _record_failure(self, read: PendingRead, error: BaseException) -> None:
        key = (read.layer, read.expert)
        record = self.failures.get(key)
        count = 1 if record is None else record.count + 1
        self.failures[key] = FailedRead(read.layer, read.expert, read.slot, count, type(error).__name__,
                                        describe_error(error), self.token)
        self._tables.retry_after[key] = self.token + 2 ** min(count, MAX_BACKOFF_DOUBLINGS)
        self._backed_off = True

    def preload(self, layer: int, experts: Iterable[int], *, timeout: float | None = None) -> None:
        """Loads experts into free slots now and publishes them (start-up, pinned sets).

        Args:
            layer: the layer; experts: expert ids of it (already resident or loading ones are skipped,
                not waited for).
            timeout: seconds to wait for the reads this call starts (None: no limit).

        Raises:
            ValueError: ``layer``, an id of ``experts`` or ``timeout`` is out of range, or the layer has fewer
                free slots than ``experts`` has ids not resident or loading (no slot is claimed, no read started).
            PreloadError: a read failed (its slot is free again; the others are published), or reads
                were still out after ``timeout`` (they publish at a later step); ``.failed`` and
                ``.pending`` list them.
            ManagerClosed: the manager was closed (before, or by another thread while this call waited).
            RuntimeError: another thread is inside the manager.
        """
        deadline = deadline_of("preload", timeout)
        self._check_open("preload")
        layer, experts = self._preload_experts(layer, experts)
        tables = self._tables
        with self._exclusive("preload"):
            failures_before = {key: record.count for key, record in self.failures.items()}
            # In order, each into the lowest free slot, as one batch of reads.
            wanted = [e for e in dict.fromkeys(experts) if not tables.held[layer, e]]
            free = np.flatnonzero(tables.state[layer] == SlotState.FREE)
            if len(wanted) > free.size:  # refused before any slot is claimed or read started
                raise ValueError(f"preload: layer {layer} has {free.size} free slot{'s' if free.size != 1 else ''} "
                                 f"for the {len(wanted)} experts not resident or loading {wanted}; nothing was read")
            placed = np.array(wanted, np.int64)
            batch = None
            if placed.size:
                read = (np.full(placed.size, layer, np.int64), placed, free[:placed.size].astype(np.int64))
                bookkeeping.claim(tables, *read)
                batch = self._start_reads("preload", *read, detached=timeout is not None)
            requested = {(layer, e) for e in wanted}
            if batch is not None:
                self._wait("preload", batch.all_done, deadline)
            self._publish_landed()
            self._snapshot = self.snapshot()
            failed = [record for key, record in self.failures.items()
                      if key in requested and record.count != failures_before.get(key, 0)]
            out = [read for read in self.pending() if (read.layer, read.expert) in requested]
        if failed or out:
            raise PreloadError(f"preload: layer {layer}: {len(failed)} read(s) failed ({_described(failed)})"
                               f" and {len(out)} still out after {timeout} s", failed, out)

    # ---- the token boundary -------------------------------------------------------------

    def step(self, reports: Sequence[LayerReport] | LayerReport, *,
             fence: Callable[[], Any] | None = None, timeout: float | None = None) -> np.ndarray:
        """The token-boundary step (module docstring); returns the next token's tables.

        Args:
            reports: one :class:`LayerReport` per layer, for the token that just ran
                with the previous snapshot; or one whose arrays carry every layer,
                ``[L, T, K]`` (as a graph hands them back in one transfer).
            fence: called first; returns once the token's gathers are done
                (e.g. ``lambda: mx.eval(outputs)`` or ``jax.block_until_ready``).
            timeout: with ``queue_depth=0``, the most seconds the step runs its loads (given, they run on a
                thread of their own, and those still out publish at a later step); None: they run inline.
                With loader threads the step never waits for reads.

        Returns:
            ``int32 [L, E]`` slot tables for the next token.

        Raises:
            ValueError: the reports or ``timeout`` are malformed (nothing is credited then, so a retry counts once).
            ManagerClosed: the manager was closed: before; by another thread while the fence ran (nothing is
                credited then, and no read starts); or while the step placed or waited for its loads (its
                bookkeeping is done then, and no further read starts).
            RuntimeError: another thread is inside ``step``, ``preload`` or ``drain`` of this
                manager. A manager serves one decode thread: concurrent calls are refused, never
                interleaved.
        """
        deadline = deadline_of("step", timeout)
        self._check_open("step")
        ids, scores, miss_ids, miss_scores = self._gather(reports)  # every report checked before any credit
        tables = self._tables
        with self._exclusive("step"):
            if fence is not None:
                fence()  # (1)
                if self._closed:  # by another thread, while the fence waited: nothing credited, no read
                    raise self._closed_meanwhile("step")
            shielded = self._ops.credit(tables, ids, scores, None, self.token, self.keep_mass,  # (2)
                                        miss_ids=miss_ids)
            self._publish_landed()  # (3)
            reads = self._ops.place(tables, miss_ids, miss_scores, shielded, token=self.token,  # (4)
                                    read_budget=self.read_budget, backing_off=bool(self.failures))
            batch = (self._start_reads("step", *reads, detached=timeout is not None)  # (5)
                     if reads[0].size else None)
            if self.decay_interval and self.token % self.decay_interval == self.decay_interval - 1:
                bookkeeping.decay(tables)
            self.token += 1
            self._snapshot = self.snapshot()  # (6)
            self._wait_for_detached(batch, "step", deadline)
            return self._snapshot

    # ---- the layer-by-layer exact loop -----------------------------------------------------

    def acquire(self, layer: int, indices, scores, *, timeout: float | None = None,
                credit: bool = True) -> np.ndarray:
        """The exact loop's step for one layer of one token: every expert the layer routed is resident
        before its experts run.

        Credits the routed set (as :meth:`step` does), publishes reads that have landed (prefetches
        among them), then reads the routed experts still missing into free slots or victims (never an
        expert this layer routed) and waits for them: the token's critical path. It waits only for the
        reads of this layer's routed experts, and for the layer's other reads in flight when they hold
        the slots it needs; reads of other layers go on meanwhile. An expert whose read fails here is not
        read again in this call. Their count and the wait go to :meth:`lookahead_stats`. Call
        :meth:`next_token` after the token's last layer.

        Args:
            layer: the layer; indices: int ``[T, K]`` its routed ids; scores: ``[T, K]`` their scores.
            timeout: seconds this call may wait for reads, in all (None: no limit).
            credit: count the routing (lookups, hits, misses, masses, LFU popularity or LRU recency).
                ``False`` for a routing already credited: reading a failed miss again counts the layer's
                routing once.

        Returns:
            ``int32 [E]``: the layer's table, every routed expert in it.

        Raises:
            ValueError: ``layer``, an id or ``timeout`` is out of range, or the layer has too few slots to
                hold its routed set beside its pinned experts.
            PreloadError: a read failed, was still out after ``timeout``, or the slots the routed experts
                need were still held by reads loading after ``timeout`` (``.pending`` lists those reads). What
                landed by then is published first: ``.failed`` holds the routed experts whose reads failed
                during this call (its own reads or earlier prefetches), ``.pending`` the reads still out, each
                expert in one of them.
            ManagerClosed: the manager was closed (before, or by another thread while this call waited).
            RuntimeError: as :meth:`step`.
        """
        deadline = deadline_of("acquire", timeout)
        if not isinstance(credit, (bool, np.bool_)):
            raise ValueError(f"acquire: credit must be a bool, got {credit!r}")
        self._check_open("acquire")
        layer, ids, scores = self._layer_routing("acquire", layer, indices, scores)
        tables, view = self._tables, self._layer_view(layer)
        with self._exclusive("acquire"):
            self._publish_landed()
            if credit:
                routed = self._ops.credit(view, ids, scores, tables.table[layer:layer + 1].copy(), self.token,
                                          self.keep_mass)
            else:
                routed = np.zeros((1, self.num_experts), bool)  # the routed set, kept from eviction
                routed[0, ids[(ids >= 0) & (ids < self.num_experts)]] = True
            wanted = np.unique(ids[(ids >= 0) & (ids < self.num_experts)])
            for expert in wanted.tolist():  # a prefetch routed once landed is used; still loading, late
                if self._unused_prefetches.pop((layer, expert), None) is not None:
                    outcome = ("prefetch_used" if tables.table[layer, expert] >= 0 else
                               "prefetch_late" if tables.held[layer, expert] else "prefetch_wasted")
                    self._lookahead[outcome][layer] += 1
            missing = wanted[tables.table[layer, wanted] < 0]
            self._lookahead["critical_reads"][layer] += missing.size
            read_here = np.zeros(self.num_experts, bool)  # the experts this call started reading
            failures_before = {key: record.count for key, record in self.failures.items() if key[0] == layer}
            start = time.perf_counter()
            try:
                while True:
                    absent = missing[~tables.held[layer, missing] & ~read_here[missing]]
                    if absent.size:
                        reads = self._ops.place(view, absent[None].astype(np.int64),
                                                np.zeros((1, absent.size), np.float32), routed, token=self.token,
                                                read_budget=None, backing_off=False)
                        if reads[0].size:
                            read_here[reads[1]] = True
                            self._start_reads("acquire", reads[0] + layer, reads[1], reads[2],
                                              detached=timeout is not None)
                            self._note_evicted_prefetches(layer)
                    unread = missing[tables.table[layer, missing] < 0]
                    if not unread.size:
                        break
                    if (~tables.held[layer, unread] & ~read_here[unread]).any():
                        # No slot for some: one frees when a read of the layer lands (a prefetch not routed).
                        awaited, landed = self._open_reads(layer), any
                    else:
                        awaited, landed = self._open_reads(layer, unread), all
                    ready = bool(awaited) and self._wait(
                        "acquire", lambda: landed(batch.all_done(positions) for batch, positions in awaited), deadline)
                    self._publish_landed()  # past the deadline too: a read that failed meanwhile is failed, not out
                    if not ready:
                        break
            finally:
                self._lookahead["critical_wait_s"][layer] += time.perf_counter() - start
                self._snapshot = self.snapshot()
            unread = missing[tables.table[layer, missing] < 0]
            if unread.size:
                self._raise_unread(layer, wanted.size, unread, failures_before, timeout)
            return self._snapshot[layer].copy()

    def _raise_unread(self, layer: int, routed_count: int, unread: np.ndarray, failures_before: dict,
                      timeout: float | None) -> None:
        """:meth:`acquire`'s error for the routed experts of ``layer`` left unread: each one still out, failed
        (a read of it, this call's or a prefetch's, failed during the call) or given no slot."""
        unread_set = set(unread.tolist())
        loading = [read for read in self.pending() if read.layer == layer]
        out = [read for read in loading if read.expert in unread_set]
        failed = [record for e in sorted(unread_set - {read.expert for read in out})
                  if (record := self.failures.get((layer, e))) is not None
                  and record.count != failures_before.get((layer, e), 0)]
        unplaced = sorted(unread_set - {read.expert for read in out} - {record.expert for record in failed})
        if unplaced and loading:
            raise PreloadError(f"acquire: layer {layer}: no slot for experts {unplaced} after {timeout} s: the "
                               f"slots they need are held by reads still loading (experts "
                               f"{sorted(read.expert for read in loading)})", failed, loading)
        if unplaced:
            raise ValueError(f"acquire: layer {layer} routed {routed_count} experts into {self.num_slots} slots; "
                             f"{unplaced} found none (the routed and the pinned are never evicted: "
                             f"give the arena more slots, or the layer fewer tokens at once)")
        parts = []
        if failed:
            parts.append(f"the reads of experts {[r.expert for r in failed]} failed ({_described(failed)})")
        if out:
            parts.append(f"the reads of experts {sorted(read.expert for read in out)} still out after {timeout} s")
        raise PreloadError(f"acquire: layer {layer}: {', '.join(parts)}", failed, out)

    def prefetch(self, layer: int, ids, scores, *, budget: int | None = None, timeout: float | None = None) -> int:
        """Starts reading predicted experts of ``layer`` (look-ahead), below its real misses.

        The predictions not already held are read best score first, up to ``budget``, into free slots
        or victims that are not predicted themselves; nothing is credited, so a prediction never used
        does not count toward LFU or LRU. The layer's :meth:`acquire` then finds them resident (once
        landed) and credits those it routes; one evicted, or never routed, is wasted.

        Args:
            layer: the layer predicted; ids: int ``[..., K]`` predicted ids (-1: none); scores: their scores.
            budget: most reads for this call (None: no limit).
            timeout: as :meth:`step`'s: with ``queue_depth=0``, the most seconds the call runs its loads.

        Returns:
            The reads started.

        Raises:
            ValueError: ``layer``, an id, ``budget`` or ``timeout`` is out of range.
            ManagerClosed: as :meth:`step`.
        """
        deadline = deadline_of("prefetch", timeout)
        self._check_open("prefetch")
        if budget is not None and (not is_int(budget)
                                   or budget < 0):
            raise ValueError(f"prefetch: budget must be an int >= 0 or None, got {budget!r}")
        layer, ids, scores = self._layer_routing("prefetch", layer, ids, scores, allow_padding=True)
        view = self._layer_view(layer)
        with self._exclusive("prefetch"):
            predicted = np.zeros((1, self.num_experts), bool)
            predicted[0, ids[ids >= 0]] = True
            reads = self._ops.place(view, ids, scores.astype(np.float32), predicted, token=self.token,
                                    read_budget=budget, backing_off=bool(self.failures))
            batch = None
            if reads[0].size:
                batch = self._start_reads("prefetch", reads[0] + layer, reads[1], reads[2],
                                          detached=timeout is not None)
                self._note_evicted_prefetches(layer)
                for expert in reads[1].tolist():
                    self._unused_prefetches[(layer, expert)] = True
                self._lookahead["prefetches"][layer] += reads[0].size
            self._wait_for_detached(batch, "prefetch", deadline)
            return int(reads[0].size)

    def next_token(self) -> np.ndarray:
        """Ends a token of the layer-by-layer loop (LFU's decay, the token clock); returns the tables."""
        self._check_open("next_token")
        with self._exclusive("next_token"):
            self._publish_landed()
            if self.decay_interval and self.token % self.decay_interval == self.decay_interval - 1:
                bookkeeping.decay(self._tables)
            self.token += 1
            self._snapshot = self.snapshot()
            return self._snapshot

    def lookahead_stats(self) -> dict[str, np.ndarray]:
        """Per layer ``[L]``: ``critical_reads`` (routed experts not resident when :meth:`acquire` ran),
        ``critical_wait_s``, ``prefetches`` (reads :meth:`prefetch` started), and of those ``prefetch_used``
        (landed when their layer routed them: hits), ``prefetch_late`` (routed while still loading: waited
        for, a critical read), ``prefetch_wasted`` (evicted or failed before any use) and
        ``prefetch_unused`` (held, not routed yet)."""
        unused = np.zeros(self.num_layers, np.int64)
        for layer, _ in self._unused_prefetches:
            unused[layer] += 1
        return {**{name: values.copy() for name, values in self._lookahead.items()}, "prefetch_unused": unused}

    def _layer_view(self, layer: int) -> Tables:
        """The tables of one layer as views (what the bookkeeping changes there, it changes here)."""
        tables, rows = self._tables, slice(layer, layer + 1)
        return Tables(table=tables.table[rows], owner=tables.owner[rows], state=tables.state[rows],
                      policy=tables.policy, priority=tables.priority[rows], pinned=tables.pinned[rows],
                      held=tables.held[rows], retry_after=tables.retry_after[rows],
                      counts={name: values[rows] for name, values in tables.counts.items()})

    def _layer_routing(self, method: str, layer, ids, scores, *, allow_padding: bool = False):
        """The layer as an int, and its ids and scores as ``[1, n]`` int64 and float64, checked."""
        layer = self._checked_layer(method, layer)
        ids, scores = int64_ids(method, "ids", ids), np.asarray(scores)
        if ids.shape != scores.shape or scores.dtype.kind not in "fiu":
            raise ValueError(f"{method}: ids must be integers and scores numbers of the same shape, got "
                             f"{ids.dtype} {ids.shape} and {scores.dtype} {scores.shape}")
        ids = ids.reshape(1, -1)
        low = -1 if allow_padding else 0
        if ids.size and (ids.min() < low or ids.max() >= self.num_experts):
            raise ValueError(f"{method}: layer {layer}'s ids must lie in [{low}, {self.num_experts}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        return layer, ids, scores.reshape(1, -1).astype(np.float64)

    def _note_evicted_prefetches(self, layer: int) -> None:
        """Prefetched experts of ``layer`` that lost their slot before any use: wasted."""
        held = self._tables.held[layer]
        for key in [key for key in self._unused_prefetches if key[0] == layer and not held[key[1]]]:
            del self._unused_prefetches[key]
            self._lookahead["prefetch_wasted"][layer] += 1

    def _gather(self, reports: Sequence[LayerReport] | LayerReport):
        """The reports as ``[L, n]`` arrays (ids, scores, miss ids, miss scores), checked."""
        stacked_report = isinstance(reports, LayerReport)
        if stacked_report:
            shape = np.shape(reports.indices)
            count = shape[0] if shape else 0
        elif isinstance(reports, Sequence) and all(isinstance(r, LayerReport) for r in reports):
            count = len(reports)
        else:
            raise ValueError(f"step: reports must be a LayerReport per layer or one LayerReport of [L, ...] arrays, "
                             f"got {type(reports).__name__}")
        if count != self.num_layers:
            raise ValueError(f"step: expected {self.num_layers} layer reports (or one report of [L, ...] "
                             f"arrays), got {count}")
        arrays = []
        for field_name, dtype in (("indices", np.int64), ("scores", np.float64), ("miss_ids", np.int64),
                                  ("miss_scores", np.float32)):
            try:
                stacked = np.asarray(getattr(reports, field_name)) if stacked_report else np.array(
                    [getattr(r, field_name) for r in reports])
            except ValueError:  # ragged across layers
                stacked = None
            if stacked is None or stacked.dtype == object or stacked.ndim == 0 or stacked.shape[0] != self.num_layers:
                raise ValueError(f"step: every layer's {field_name} must have one shape")
            if field_name.endswith(("indices", "ids")):
                stacked = int64_ids("step", field_name, stacked)
            elif stacked.dtype.kind not in "fiu" and stacked.dtype.name != "bfloat16":
                raise ValueError(f"step: {field_name} must be numbers, got dtype {stacked.dtype}")
            arrays.append(stacked.reshape(self.num_layers, -1).astype(dtype, copy=False))
        ids, scores, miss_ids, miss_scores = arrays
        if ids.shape != scores.shape or miss_ids.shape != miss_scores.shape:
            raise ValueError(f"step: scores must have the shape of indices and miss_scores that of miss_ids, got "
                             f"{scores.shape} / {ids.shape} and {miss_scores.shape} / {miss_ids.shape}")
        if miss_ids.size and (miss_ids.min() < -1 or miss_ids.max() >= self.num_experts):
            bad = (miss_ids < -1) | (miss_ids >= self.num_experts)
            layer = int(np.argwhere(bad)[0, 0])
            raise ValueError(f"step: layer {layer}'s miss_ids hold {int(miss_ids[bad][0])}, outside "
                             f"[-1, {self.num_experts})")
        return ids, scores, miss_ids, miss_scores

    # ---- statistics ---------------------------------------------------------------------

    def stats(self) -> tuple[list[LayerStats], LayerStats]:
        """(per-layer counters, their sum)."""
        per_layer = [LayerStats(**{name: self._tables.counts[name][layer].item() for name in _COUNTERS})
                     for layer in range(self.num_layers)]
        total = LayerStats()
        for layer_stats in per_layer:
            total.add(layer_stats)
        return per_layer, total
