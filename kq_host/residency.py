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

A read that fails (the loader raises, or the arena refuses its payload) leaves its
slot free and its expert unpublished; :attr:`ResidencyManager.failures` keeps one
record per expert (a count and the last error's text), and the expert is not read
again for 2, 4, 8, ... tokens (up to 1024) after each failure in a row.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from kq_host.arena import Arena, write_landed

Loader = Callable[[int, int, int], Any]  # (layer, expert, slot) -> payload for the arena, or None



class SlotState(enum.IntEnum):
    FREE = 0
    LOADING = 1
    RESIDENT = 2


@dataclass
class LayerStats:
    """Counters of one layer (or of all layers, summed)."""

    lookups: int = 0  # routed entries with a valid expert id
    hits: int = 0  # of those, resident in the token's snapshot
    misses: int = 0  # valid and not resident: shed and reported
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


_FREE, _LOADING, _RESIDENT = SlotState.FREE.value, SlotState.LOADING.value, SlotState.RESIDENT.value


def _group_starts(counts: np.ndarray) -> np.ndarray:
    """Where each group begins among items sorted by group, from the groups' sizes."""
    return np.cumsum(counts) - counts


def _rank_within(groups: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For each item, how many items of its group come before it (items in order); ``counts``: the
    groups' sizes (``np.bincount(groups)``)."""
    order = np.argsort(groups, kind="stable")
    rank = np.empty(groups.size, np.int64)
    rank[order] = np.arange(groups.size) - _group_starts(counts)[groups[order]]
    return rank


def _ranked_slots(mask: np.ndarray, priority: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """``[n, S]``: row i lists its slots where ``mask`` holds, by ascending (priority, owner), then -1s.

    The masked slots' owners are distinct within a row (one slot per expert), so (priority, owner)
    orders them totally.
    """
    order = np.lexsort((owner, np.where(mask, priority, np.inf)), axis=1)
    return np.where(np.arange(mask.shape[1]) < mask.sum(axis=1, keepdims=True), order, -1)


class _ReadBatch:
    """The reads one step (or one preload) submits, in order. Inline, the caller runs them at once;
    with a pool, up to ``queue_depth`` workers each take the next unclaimed read until none is left, so
    a token's reads cost a few task submissions, not one each, and still start best first. Outcomes are
    kept by position: a payload, or the exception the read raised (``failed``)."""

    def __init__(self, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray):
        self.layers, self.experts, self.slots = layers, experts, slots
        self._reads = (layers.tolist(), experts.tolist(), slots.tolist())  # what the loader is called with
        self.outcomes: list[Any] = [None] * layers.size
        # Written by the workers byte by byte, read by the publisher as bool arrays (views, no copy).
        self._failed, self._done = bytearray(layers.size), bytearray(layers.size)
        self.failed = np.frombuffer(self._failed, bool)
        self.done = np.frombuffer(self._done, bool)
        self.open = np.ones(layers.size, bool)  # not yet published
        self.futures: list[Future] = []
        self._claims = itertools.count()  # next() on it is atomic in CPython: each read is claimed once

    def run(self, loader: Loader, cancelled: threading.Event | None = None) -> None:
        layers, experts, slots = self._reads
        outcomes, failed, done, count = self.outcomes, self._failed, self._done, len(layers)
        for index in self._claims:
            if index >= count or (cancelled is not None and cancelled.is_set()):
                return
            try:
                outcomes[index] = loader(layers[index], experts[index], slots[index])
            except BaseException as error:  # noqa: BLE001 - a failed read; published as one in (3)
                outcomes[index] = error
                failed[index] = 1
            done[index] = 1


@dataclass
class LayerReport:
    """What the host reads back from one layer's graph for one token (NumPy arrays).

    Attributes:
        indices: ``[T, K]`` routed ids; scores: ``[T, K]`` routed scores;
        miss_ids / miss_scores: ``route_shed``'s miss lists ``[T, K]``.
    """

    indices: np.ndarray
    scores: np.ndarray
    miss_ids: np.ndarray
    miss_scores: np.ndarray

    @classmethod
    def stacked(cls, reports: Sequence["LayerReport"]) -> "LayerReport":
        """One report of ``[L, T, K]`` arrays from one report per layer (what :meth:`ResidencyManager.step`
        takes in one piece)."""
        return cls(*(np.stack([getattr(r, f.name) for r in reports]) for f in fields(cls)))


_COUNTERS = tuple(f.name for f in fields(LayerStats))


class ManagerBase:
    """What every residency manager shares: its arguments, checked; the read queue and its
    lifecycle (``pending``, ``drain``, ``close``); the one-thread guard.

    A subclass builds its tables after ``__init__`` (``pinned_experts`` holds the checked
    pinned sets), sets ``_snapshot``, keeps its reads in flight in ``_pending`` as it likes, and
    defines ``snapshot()``, ``pending()`` and ``_publish_landed(timeout=...)``.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *, loader: Loader,
                 arena: Arena | None, policy: str, pinned: Mapping[int, Iterable[int]] | None, keep_mass: float,
                 read_budget: int | None, decay_interval: int, queue_depth: int, bytes_per_expert: int):
        for name, value, minimum in (("num_layers", num_layers, 1), ("num_experts", num_experts, 1),
                                     ("num_slots", num_slots, 1), ("queue_depth", queue_depth, 0),
                                     ("decay_interval", decay_interval, 0), ("bytes_per_expert", bytes_per_expert, 0),
                                     ("read_budget", 0 if read_budget is None else read_budget, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"ResidencyManager: {name} must be an int >= {minimum}, got {value!r}")
        if policy not in ("lfu", "lru"):
            raise ValueError(f"ResidencyManager: policy must be 'lfu' or 'lru', got {policy!r}")
        if not 0.0 <= keep_mass <= 1.0:
            raise ValueError(f"ResidencyManager: keep_mass must be in [0, 1], got {keep_mass}")
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.loader, self.arena, self.policy = loader, arena, policy
        self.keep_mass, self.read_budget, self.decay_interval = keep_mass, read_budget, decay_interval
        self.bytes_per_expert, self.queue_depth = bytes_per_expert, queue_depth
        self.pinned_experts: dict[int, set[int]] = {}
        for layer, experts in (pinned or {}).items():
            experts = [int(e) for e in experts]
            if not 0 <= layer < num_layers or any(not 0 <= e < num_experts for e in experts):
                raise ValueError(f"ResidencyManager: pinned maps layers in [0, {num_layers}) to expert ids in "
                                 f"[0, {num_experts}), got layer {layer}: {experts}")
            if len(set(experts)) > num_slots:
                raise ValueError(f"ResidencyManager: layer {layer} pins {len(set(experts))} experts into "
                                 f"{num_slots} slots")
            self.pinned_experts[layer] = set(experts)
        self._pool = (ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="kq-prestage") if queue_depth
                      else None)
        self._pending: list = []
        self._cancelled = threading.Event()  # set by close: pooled workers start no further read
        self.failures: dict[tuple[int, int], FailedRead] = {}
        self._busy = threading.Lock()
        self.token = 0

    def _preload_experts(self, layer: int, experts: Iterable[int]) -> list[int]:
        """``preload``'s arguments, checked: the expert ids as ints."""
        experts = [int(e) for e in experts]
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"preload: layer must be in [0, {self.num_layers}), got {layer}")
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"preload: experts must be ids in [0, {self.num_experts}), got {bad}")
        return experts

    @contextlib.contextmanager
    def _exclusive(self, method: str):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"ResidencyManager.{method}: called from two threads at once; a manager serves one "
                               f"decode thread (call it from that thread, or give each thread its own manager)")
        try:
            yield
        finally:
            self._busy.release()

    def drain(self, timeout: float | None = None) -> list[PendingRead]:
        """Waits up to ``timeout`` seconds (None: no limit) for the reads in flight and publishes those done.

        Returns:
            The reads still out (they stay pending and publish at a later step or drain).
        """
        with self._exclusive("drain"):
            self._publish_landed(timeout=timeout)
            self._snapshot = self.snapshot()
            return self.pending()

    def close(self, timeout: float | None = 30.0) -> list[PendingRead]:
        """Publishes what lands within ``timeout`` seconds, then stops the loader threads.

        Reads not started are cancelled; a loader still running is left to finish on its own thread
        (Python cannot stop it), and its result is dropped.

        Returns:
            The reads that were still out.
        """
        out = self.drain(timeout)
        self._cancelled.set()
        if self._pool is not None:
            self._pool.shutdown(wait=not out, cancel_futures=True)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ResidencyManager(ManagerBase):
    """Per-layer slot tables, eviction policy, prestage reads and statistics.

    The state of all layers lives in ``[L, E]`` and ``[L, S]`` arrays; each
    token's bookkeeping is array operations over the routed entries, the missed
    experts and their layers, and its reads go out as one batch.

    Args:
        num_layers, num_experts, num_slots: L, E and S (slots per layer).
        loader: ``loader(layer, expert, slot)`` run on a worker thread; it reads
            the expert (e.g. ``ExpertStore.read_expert``) and either writes it
            into the slot itself and returns None, or returns a payload that
            ``arena.write_slot`` writes at publish time on the caller's thread
            (JAX and MLX arenas). An exception marks the read failed.
        arena: optional :class:`Arena` for payload-returning loaders.
        policy: ``"lfu"`` (default; popularity credited from each token's
            routed set, halved every ``decay_interval`` tokens) or ``"lru"``.
        pinned: ``{layer: expert ids}`` never evicted (load them with :meth:`preload`).
        keep_mass: the shed-mass budget; a layer whose shed mass in a token
            exceeds ``1 - keep_mass`` of its routed mass is counted in ``over_budget``.
        read_budget: reads submitted per token, over all layers (None: no limit).
        queue_depth: concurrent loader threads; 0 runs loads inline (deterministic tests).
        bytes_per_expert: added to ``bytes_read`` per landed read when the loader
            returns no byte count (an int return value is taken as bytes read).
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *, loader: Loader,
                 arena: Arena | None = None, policy: Literal["lfu", "lru"] = "lfu",
                 pinned: Mapping[int, Iterable[int]] | None = None, keep_mass: float = 0.9,
                 read_budget: int | None = None, decay_interval: int = 64, queue_depth: int = 8,
                 bytes_per_expert: int = 0):
        super().__init__(num_layers, num_experts, num_slots, loader=loader, arena=arena, policy=policy,
                         pinned=pinned, keep_mass=keep_mass, read_budget=read_budget, decay_interval=decay_interval,
                         queue_depth=queue_depth, bytes_per_expert=bytes_per_expert)
        shape_e, shape_s = (num_layers, num_experts), (num_layers, num_slots)
        self._table = np.full(shape_e, -1, np.int32)  # the live tables (what the next snapshot copies)
        self._owner = np.full(shape_s, -1, np.int32)  # expert in (or loading into) each slot, -1 free
        self._state = np.zeros(shape_s, np.int8)  # SlotState
        self._popularity = np.zeros(shape_e)  # LFU credit
        self._last_used = np.full(shape_e, -1, np.int64)  # LRU clock
        self._pinned = np.zeros(shape_e, bool)
        self._held = np.zeros(shape_e, bool)  # the expert owns a slot (loading or resident)
        self._retry_after = np.zeros(shape_e, np.int64)  # first token to read an expert again after failures
        self._layer_offsets = np.arange(num_layers)[:, None] * num_experts  # [L, 1]: layer l's [L * E] offset
        self._counts = {name: np.zeros(num_layers, np.float64 if name.endswith("mass") else np.int64)
                        for name in _COUNTERS}
        for layer, experts in self.pinned_experts.items():
            self._pinned[layer, sorted(experts)] = True
        self._snapshot = self.snapshot()

    # ---- tables -------------------------------------------------------------------------

    def snapshot(self) -> np.ndarray:
        """A copy of every layer's table, ``int32 [L, E]``: what the next graph may use."""
        return self._table.copy()

    def resident(self, layer: int) -> dict[int, int]:
        """``{expert: slot}`` published in ``layer``."""
        table = self._table[layer]
        return {int(e): int(table[e]) for e in np.flatnonzero(table >= 0)}

    def slot_owner(self, layer: int) -> np.ndarray:
        """``int32 [S]``: the expert resident in or loading into each slot, -1 free."""
        return self._owner[layer].copy()

    # ---- loading ------------------------------------------------------------------------

    def _submit(self, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray) -> None:
        """Marks the slots LOADING for their experts and starts their reads, in order."""
        self._owner[layers, slots] = experts
        self._state[layers, slots] = _LOADING
        self._held[layers, experts] = True
        self._counts["reads_submitted"] += np.bincount(layers, minlength=self.num_layers)
        batch = _ReadBatch(layers, experts, slots)
        if self._pool is None:
            batch.run(self.loader)
        else:
            batch.futures = [self._pool.submit(batch.run, self.loader, self._cancelled)
                             for _ in range(min(self.queue_depth, layers.size))]
        self._pending.append(batch)

    def pending(self) -> list[PendingRead]:
        """The reads submitted and not yet published."""
        return [PendingRead(int(layer), int(expert), int(slot)) for batch in self._pending
                for layer, expert, slot in zip(batch.layers[batch.open], batch.experts[batch.open],
                                                batch.slots[batch.open])]

    def _publish_landed(self, *, timeout: float | None = 0.0) -> None:
        """Publishes the reads done within ``timeout`` seconds (0: those done now; None: all)."""
        futures = [future for batch in self._pending for future in batch.futures]
        if futures and timeout != 0.0:
            wait_for_futures(futures, timeout=timeout)
        interrupt = None
        for batch in self._pending:
            ready = np.flatnonzero(batch.done & batch.open)
            if ready.size == 0:
                continue
            batch.open[ready] = False
            if ready.size == len(batch.outcomes):  # the whole batch at once: the batch's list is handed over
                picked, batch.outcomes = batch.outcomes, [None] * ready.size
            else:
                picked = [batch.outcomes[i] for i in ready.tolist()]  # payloads, or the reads' exceptions
                for i in ready.tolist():
                    batch.outcomes[i] = None  # no payload kept alive past its publishing
            failed = batch.failed[ready]
            if self.arena is not None and not failed.all():
                written = np.flatnonzero(~failed)
                refused = write_landed(self.arena, batch.layers[ready[written]], batch.slots[ready[written]],
                                       [picked[j] for j in written.tolist()])
                for j, error in zip(written.tolist(), refused):
                    if error is not None:
                        failed[j], picked[j] = True, error
            for j in np.flatnonzero(failed).tolist():
                error = picked[j]
                self._record_failure(PendingRead(int(batch.layers[ready[j]]), int(batch.experts[ready[j]]),
                                                 int(batch.slots[ready[j]])), error)
                if isinstance(error, (KeyboardInterrupt, SystemExit)) and interrupt is None:
                    interrupt = error
            lost, landed = ready[failed], ready[~failed]
            if lost.size:
                self._owner[batch.layers[lost], batch.slots[lost]] = -1
                self._state[batch.layers[lost], batch.slots[lost]] = _FREE
                self._held[batch.layers[lost], batch.experts[lost]] = False
                self._counts["reads_failed"] += np.bincount(batch.layers[lost], minlength=self.num_layers)
            if landed.size:  # published together: the tables point at their slots only now
                layers, experts, slots = batch.layers[landed], batch.experts[landed], batch.slots[landed]
                default = self.bytes_per_expert
                nbytes = np.array([payload if isinstance(payload, int) else default
                                   for payload, lost_read in zip(picked, failed.tolist()) if not lost_read], np.int64)
                self._table[layers, experts] = slots
                self._state[layers, slots] = _RESIDENT
                self._counts["reads_landed"] += np.bincount(layers, minlength=self.num_layers)
                self._counts["bytes_read"] += np.bincount(layers, weights=nbytes, minlength=self.num_layers).astype(
                    np.int64)
                self._retry_after[layers, experts] = 0
                if self.failures:
                    for key in zip(layers.tolist(), experts.tolist()):
                        self.failures.pop(key, None)
        self._pending = [batch for batch in self._pending if batch.open.any()]
        if interrupt is not None:  # after the bookkeeping, so no later step sees this read again
            raise interrupt

    def _record_failure(self, read: PendingRead, error: BaseException) -> None:
        key = (read.layer, read.expert)
        record = self.failures.get(key)
        count = 1 if record is None else record.count + 1
        self.failures[key] = FailedRead(read.layer, read.expert, read.slot, count, type(error).__name__, str(error),
                                        self.token)
        self._retry_after[key] = self.token + 2 ** min(count, MAX_BACKOFF_DOUBLINGS)

    def preload(self, layer: int, experts: Iterable[int]) -> None:
        """Loads experts into free slots now and publishes them (start-up, pinned sets).

        Raises:
            ValueError: ``layer`` or an id of ``experts`` is out of range, or no slot is free.
        """
        experts = self._preload_experts(layer, experts)
        with self._exclusive("preload"):
            for expert in experts:
                if self._table[layer, expert] >= 0 or expert in self._owner[layer]:
                    continue
                free = np.flatnonzero(self._state[layer] == _FREE)
                if free.size == 0:
                    raise ValueError(f"preload: layer {layer} has no free slot for expert {expert}")
                self._submit(*(np.array([value], np.int64) for value in (layer, expert, free[0])))
            self._publish_landed(timeout=None)
            self._snapshot = self.snapshot()

    # ---- the token boundary -------------------------------------------------------------

    def step(self, reports: Sequence[LayerReport] | LayerReport, *,
             fence: Callable[[], Any] | None = None) -> np.ndarray:
        """The token-boundary step (module docstring); returns the next token's tables.

        Args:
            reports: one :class:`LayerReport` per layer, for the token that just ran
                with the previous snapshot; or one whose arrays carry every layer,
                ``[L, T, K]`` (as a graph hands them back in one transfer).
            fence: called first; returns once the token's gathers are done
                (e.g. ``lambda: mx.eval(outputs)`` or ``jax.block_until_ready``).

        Returns:
            ``int32 [L, E]`` slot tables for the next token.

        Raises:
            ValueError: the reports are malformed (nothing is credited then, so a retry counts once).
            RuntimeError: another thread is inside ``step``, ``preload`` or ``drain`` of this
                manager. A manager serves one decode thread: concurrent calls are refused, never
                interleaved.
        """
        routed = self._gather(reports)  # every report checked before anything is credited
        with self._exclusive("step"):
            if fence is not None:
                fence()  # (1)
            shielded = self._credit(*routed[:2])  # (2)
            self._publish_landed()  # (3)
            self._schedule(*routed[2:], shielded)  # (4) and (5)
            if self.decay_interval and self.token % self.decay_interval == self.decay_interval - 1:
                self._popularity *= 0.5
            self.token += 1
            self._counts["reads_in_flight"][:] = sum(
                (np.bincount(batch.layers[batch.open], minlength=self.num_layers) for batch in self._pending),
                np.zeros(self.num_layers, np.int64))
            self._snapshot = self.snapshot()  # (6)
            return self._snapshot

    def _gather(self, reports: Sequence[LayerReport] | LayerReport):
        """The reports as ``[L, n]`` arrays (ids, scores, miss ids, miss scores), checked."""
        stacked_report = isinstance(reports, LayerReport)
        if stacked_report:
            shape = np.shape(reports.indices)
            count = shape[0] if shape else 0
        else:
            count = len(reports)
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
            arrays.append(stacked.reshape(self.num_layers, -1).astype(dtype, copy=False))
        ids, scores, miss_ids, miss_scores = arrays
        if ids.shape != scores.shape or miss_ids.shape != miss_scores.shape:
            raise ValueError(f"step: scores must have the shape of indices and miss_scores that of miss_ids, got "
                             f"{scores.shape} / {ids.shape} and {miss_scores.shape} / {miss_ids.shape}")
        bad = (miss_ids < -1) | (miss_ids >= self.num_experts)
        if bad.any():
            layer = int(np.argwhere(bad)[0, 0])
            raise ValueError(f"step: layer {layer}'s miss_ids hold {int(miss_ids[bad][0])}, outside "
                             f"[-1, {self.num_experts})")
        return ids, scores, miss_ids, miss_scores

    def _credit(self, ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """(2): popularity, recency and statistics from the routed entries; returns the routed mask ``[L, E]``."""
        num_experts = self.num_experts
        valid = (ids >= 0) & (ids < num_experts)
        flat_all = self._layer_offsets + np.where(valid, ids, 0)  # [L, n] into the [L * E] arrays
        kept = valid & (self._snapshot.reshape(-1)[flat_all] >= 0)
        flat = flat_all[valid]  # layer-major, in entry order
        np.add.at(self._popularity.reshape(-1), flat, 1.0)
        self._last_used.reshape(-1)[flat] = self.token
        routed = np.zeros(self._table.shape, bool)
        routed.reshape(-1)[flat] = True
        numbers = np.where(np.isnan(scores), 0.0, scores)  # NaN counts as no mass (np.nansum's sums)
        shed_mass = np.where(kept, 0.0, numbers).sum(axis=1)
        routed_mass = numbers.sum(axis=1)
        counts = self._counts
        counts["lookups"] += valid.sum(axis=1)
        counts["hits"] += kept.sum(axis=1)
        counts["misses"] += (valid & ~kept).sum(axis=1)
        counts["shed_count"] += (~kept).sum(axis=1)
        counts["shed_mass"] += shed_mass
        counts["routed_mass"] += routed_mass
        counts["over_budget"] += shed_mass > (1.0 - self.keep_mass) * routed_mass
        return routed

    def _schedule(self, miss_ids: np.ndarray, miss_scores: np.ndarray, shielded: np.ndarray) -> None:
        """(4) and (5): the token's misses, best first over all layers, each into a free slot or a victim's.

        Works on the missed experts and the layers they are in, never on every [L, E] entry.
        """
        num_layers, num_experts = self.num_layers, self.num_experts
        real = miss_ids >= 0
        flat = (self._layer_offsets + miss_ids)[real]
        if flat.size == 0:
            return
        # Each missed expert once, keyed by its best miss score (an expert missed only with NaN: +inf, last).
        scores = miss_scores[real]
        key = np.where(np.isnan(scores), np.inf, -scores.astype(np.float64))
        order = np.lexsort((key, flat))  # by expert, its best entry first
        flat, key = flat[order], key[order]
        first = np.ones(flat.size, bool)
        first[1:] = flat[1:] != flat[:-1]
        missed, key = flat[first], key[first]
        layers, experts = np.divmod(missed, num_experts)
        wanted = ~self._held[layers, experts] & (self._retry_after[layers, experts] <= self.token)
        if not wanted.any():
            return
        candidates = missed[wanted]
        # Best miss score first, then lower layer, then lower id.
        candidates = candidates[np.lexsort((candidates, key[wanted]))]
        if self.read_budget is not None:
            candidates = candidates[:self.read_budget]
        layers, experts = np.divmod(candidates, num_experts)
        # Within its layer, the r-th candidate takes the r-th free slot (ascending), and past the free
        # ones the next victim: the resident, unpinned slots whose experts this token did not route,
        # lowest priority first, ties by lower expert id (so traces are reproducible).
        per_layer = np.bincount(layers, minlength=num_layers)
        rank = _rank_within(layers, per_layer)
        present = per_layer > 0
        rows = np.flatnonzero(present)  # the layers with a candidate
        row_of = (np.cumsum(present) - 1)[layers]
        # Every row's free slots, ascending, row after row (nonzero runs row-major).
        free_row, free_slot = np.nonzero(self._state[rows] == _FREE)
        free_count = np.bincount(free_row, minlength=rows.size)
        first_free = _group_starts(free_count)
        free_count = free_count[row_of]
        from_free = rank < free_count
        slots = np.full(candidates.size, -1, np.int64)
        slots[from_free] = free_slot[(first_free[row_of] + rank)[from_free]]
        victims = ~from_free
        if victims.any():
            short = np.zeros(rows.size, bool)
            short[row_of[victims]] = True  # only the layers that need victims are ranked
            short_rows = rows[short]
            owner = self._owner[short_rows]
            owners = np.maximum(owner, 0)
            layer_rows = short_rows[:, None]
            priority = self._popularity if self.policy == "lfu" else self._last_used
            eligible = ((self._state[short_rows] == _RESIDENT) & ~self._pinned[layer_rows, owners]
                        & ~shielded[layer_rows, owners])
            victim_at = np.full((rows.size, self.num_slots), -1, np.int64)
            victim_at[short] = _ranked_slots(eligible, priority[layer_rows, owners], owner)
            eligible_count = np.zeros(rows.size, np.int64)
            eligible_count[short] = eligible.sum(axis=1)
            victim_rank = rank - free_count
            victims &= victim_rank < eligible_count[row_of]
            slots[victims] = victim_at[row_of[victims], victim_rank[victims]]
        placed = slots >= 0  # a candidate with no free slot and no victim in its layer waits
        layers, experts, slots, victims = layers[placed], experts[placed], slots[placed], victims[placed]
        # (4) the victims leave the tables before any read targets their slots.
        evicted_layers, evicted_slots = layers[victims], slots[victims]
        evicted_experts = self._owner[evicted_layers, evicted_slots]
        self._table[evicted_layers, evicted_experts] = -1
        self._held[evicted_layers, evicted_experts] = False
        self._counts["evictions"] += np.bincount(evicted_layers, minlength=num_layers)
        # (5) the reads, in order.
        self._submit(layers, experts, slots)

    # ---- statistics ---------------------------------------------------------------------

    def stats(self) -> tuple[list[LayerStats], LayerStats]:
        """(per-layer counters, their sum)."""
        per_layer = [LayerStats(**{name: self._counts[name][layer].item() for name in _COUNTERS})
                     for layer in range(self.num_layers)]
        total = LayerStats()
        for layer_stats in per_layer:
            total.add(layer_stats)
        return per_layer, total
