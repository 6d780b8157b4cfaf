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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from kq_host.arena import Arena

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


def _rank_within(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """For each item, how many items of its group come before it (items in order)."""
    order = np.argsort(groups, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(groups, minlength=num_groups))[:-1]])
    rank = np.empty(groups.size, np.int64)
    rank[order] = np.arange(groups.size) - starts[groups[order]]
    return rank


def _ranked_slots(mask: np.ndarray, priority: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """``[L, S]``: row l lists layer l's slots where ``mask`` holds, by ascending (priority, owner, slot)."""
    out = np.full(mask.shape, -1, np.int64)
    rows = np.flatnonzero(mask.any(axis=1))
    if rows.size:
        held = mask[rows]
        slots = np.broadcast_to(np.arange(mask.shape[1]), held.shape)
        # One sort per row along the slots: the masked slots first, then by priority, owner, slot.
        order = np.lexsort((slots, owner[rows], priority[rows], ~held), axis=-1)
        out[rows] = np.where(slots < held.sum(axis=1, keepdims=True), order, -1)
    return out


class _Landed:
    """An inline read's outcome, shaped like the part of a Future the manager uses."""

    __slots__ = ("value", "error")

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def done(self) -> bool:
        return True

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _Pending:
    layer: int
    expert: int
    slot: int
    future: Future | _Landed


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


_COUNTERS = tuple(f.name for f in fields(LayerStats))


class ManagerBase:
    """What every residency manager shares: its arguments, checked; the read queue and its
    lifecycle (``pending``, ``drain``, ``close``); the one-thread guard.

    A subclass builds its tables after ``__init__`` (``pinned_experts`` holds the checked
    pinned sets), sets ``_snapshot``, and defines ``snapshot()`` and ``_publish_landed(timeout=...)``.
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
        self.bytes_per_expert = bytes_per_expert
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

    def pending(self) -> list[PendingRead]:
        """The reads submitted and not yet published."""
        return [PendingRead(read.layer, read.expert, read.slot) for read in self._pending]

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
        if self._pool is not None:
            self._pool.shutdown(wait=not out, cancel_futures=True)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ResidencyManager(ManagerBase):
    """Per-layer slot tables, eviction policy, prestage reads and statistics.

    The state of all layers lives in ``[L, E]`` and ``[L, S]`` arrays and each
    token's bookkeeping is a handful of array operations over every layer at
    once; only the reads themselves are submitted one by one.

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
        self._retry_after = np.zeros(shape_e, np.int64)  # first token to read an expert again after failures
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

    def _submit(self, layer: int, expert: int, slot: int) -> None:
        self._owner[layer, slot] = expert
        self._state[layer, slot] = _LOADING
        self._counts["reads_submitted"][layer] += 1
        self._start(layer, expert, slot)

    def _start(self, layer: int, expert: int, slot: int) -> None:
        """Runs (inline) or queues one read whose slot is already marked LOADING for ``expert``."""
        if self._pool is None:
            try:
                future = _Landed(self.loader(layer, expert, slot))
            except BaseException as error:  # noqa: BLE001 - a failed read; published as one in (3)
                future = _Landed(error=error)
        else:
            future = self._pool.submit(self.loader, layer, expert, slot)
        self._pending.append(_Pending(layer, expert, slot, future))

    def _publish_landed(self, *, timeout: float | None = 0.0) -> None:
        """Publishes the reads done within ``timeout`` seconds (0: those done now; None: all)."""
        futures = [read.future for read in self._pending if isinstance(read.future, Future)]
        if futures and timeout != 0.0:
            wait_for_futures(futures, timeout=timeout)
        still, landed, interrupt = [], [], None
        for read in self._pending:
            if not read.future.done():
                still.append(read)
                continue
            try:
                payload = read.future.result()
                if self.arena is not None:
                    self.arena.write_slot(read.layer, read.slot, payload)
            except BaseException as error:  # noqa: BLE001 - reported; the slot stays unpublished and free
                self._owner[read.layer, read.slot] = -1
                self._state[read.layer, read.slot] = _FREE
                self._counts["reads_failed"][read.layer] += 1
                self._record_failure(read, error)
                if isinstance(error, (KeyboardInterrupt, SystemExit)) and interrupt is None:
                    interrupt = error
                continue
            landed.append((read.layer, read.expert, read.slot,
                           payload if isinstance(payload, int) else self.bytes_per_expert))
        self._pending = still
        if landed:  # published together: the tables point at their slots only now
            layers, experts, slots, nbytes = (np.array(column, np.int64) for column in zip(*landed))
            self._table[layers, experts] = slots
            self._state[layers, slots] = _RESIDENT
            self._counts["reads_landed"] += np.bincount(layers, minlength=self.num_layers)
            np.add.at(self._counts["bytes_read"], layers, nbytes)
            self._retry_after[layers, experts] = 0
            if self.failures:
                for key in zip(layers.tolist(), experts.tolist()):
                    self.failures.pop(key, None)
        if interrupt is not None:  # after the bookkeeping, so no later step sees this read again
            raise interrupt

    def _record_failure(self, read: _Pending, error: BaseException) -> None:
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
                self._submit(layer, expert, int(free[0]))
            self._publish_landed(timeout=None)
            self._snapshot = self.snapshot()

    # ---- the token boundary -------------------------------------------------------------

    def step(self, reports: Sequence[LayerReport], *, fence: Callable[[], Any] | None = None) -> np.ndarray:
        """The token-boundary step (module docstring); returns the next token's tables.

        Args:
            reports: one :class:`LayerReport` per layer, for the token that just ran
                with the previous snapshot.
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
            self._counts["reads_in_flight"][:] = np.bincount([read.layer for read in self._pending],
                                                             minlength=self.num_layers)
            self._snapshot = self.snapshot()  # (6)
            return self._snapshot

    def _gather(self, reports: Sequence[LayerReport]):
        """The reports as ``[L, n]`` arrays (ids, scores, miss ids, miss scores), checked."""
        if len(reports) != self.num_layers:
            raise ValueError(f"step: expected {self.num_layers} layer reports, got {len(reports)}")
        arrays = []
        for field_name, dtype in (("indices", np.int64), ("scores", np.float64), ("miss_ids", np.int64),
                                  ("miss_scores", np.float32)):
            try:
                stacked = np.array([getattr(r, field_name) for r in reports])
            except ValueError:  # ragged across layers
                stacked = None
            if stacked is None or stacked.dtype == object:
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
        safe = np.where(valid, ids, 0)
        kept = valid & (np.take_along_axis(self._snapshot, safe, axis=1) >= 0)
        flat = (np.arange(self.num_layers)[:, None] * num_experts + safe)[valid]  # layer-major, in entry order
        np.add.at(self._popularity.reshape(-1), flat, 1.0)
        self._last_used.reshape(-1)[flat] = self.token
        routed = np.zeros(self._table.shape, bool)
        routed.reshape(-1)[flat] = True
        shed_mass = np.nansum(np.where(kept, 0.0, scores), axis=1)
        routed_mass = np.nansum(scores, axis=1)
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
        """(4) and (5): the token's misses, best first over all layers, each into a free slot or a victim's."""
        num_layers, num_experts = self.num_layers, self.num_experts
        real = miss_ids >= 0
        flat = (np.arange(num_layers)[:, None] * num_experts + miss_ids)[real]
        scores = miss_scores[real]
        numbers = ~np.isnan(scores)
        counts = np.bincount(flat, minlength=num_layers * num_experts)
        best = np.full(num_layers * num_experts, -np.inf, np.float32)
        np.maximum.at(best, flat[numbers], scores[numbers])
        with_number = np.bincount(flat[numbers], minlength=num_layers * num_experts) > 0
        owned = np.zeros(num_layers * num_experts, bool)
        held = self._owner >= 0
        owned[(np.arange(num_layers)[:, None] * num_experts + self._owner)[held]] = True
        wanted = ((counts > 0) & (self._table.reshape(-1) < 0) & ~owned
                  & (self._retry_after.reshape(-1) <= self.token))
        candidates = np.flatnonzero(wanted)
        if candidates.size == 0:
            return
        # Best miss score first (an expert missed only with NaN last), then lower layer, then lower id.
        key = np.where(with_number[candidates], -best[candidates].astype(np.float64), np.inf)
        candidates = candidates[np.lexsort((candidates, key))]
        if self.read_budget is not None:
            candidates = candidates[:self.read_budget]
        layers, experts = np.divmod(candidates, num_experts)
        # Within its layer, the r-th candidate takes the r-th free slot (ascending), and past the free
        # ones the next victim: the resident, unpinned slots whose experts this token did not route,
        # lowest priority first, ties by lower expert id (so traces are reproducible).
        rank = _rank_within(layers, num_layers)
        free = self._state == _FREE
        free_layer, free_slot = np.nonzero(free)  # by layer, then ascending slot
        free_at = np.full(free.shape, -1, np.int64)
        free_at[free_layer, _rank_within(free_layer, num_layers)] = free_slot
        free_count = free.sum(axis=1)[layers]
        from_free = rank < free_count
        slots = np.full(candidates.size, -1, np.int64)
        slots[from_free] = free_at[layers[from_free], rank[from_free]]
        victims = ~from_free
        if victims.any():
            short = np.zeros(num_layers, bool)
            short[layers[victims]] = True  # only the layers that need victims are ranked
            owners = np.maximum(self._owner, 0)
            priority = self._popularity if self.policy == "lfu" else self._last_used
            layer_rows = np.arange(num_layers)[:, None]
            eligible = (short[:, None] & (self._state == _RESIDENT) & ~self._pinned[layer_rows, owners]
                        & ~shielded[layer_rows, owners])
            victim_at = _ranked_slots(eligible, priority[layer_rows, owners], self._owner)
            victim_rank = rank - free_count
            victims &= victim_rank < eligible.sum(axis=1)[layers]
            slots[victims] = victim_at[layers[victims], victim_rank[victims]]
        placed = slots >= 0  # a candidate with no free slot and no victim in its layer waits
        layers, experts, slots, victims = layers[placed], experts[placed], slots[placed], victims[placed]
        # (4) the victims leave the tables before any read targets their slots.
        evicted_layers, evicted_slots = layers[victims], slots[victims]
        self._table[evicted_layers, self._owner[evicted_layers, evicted_slots]] = -1
        self._counts["evictions"] += np.bincount(evicted_layers, minlength=num_layers)
        # (5) the reads, in order.
        self._owner[layers, slots] = experts
        self._state[layers, slots] = _LOADING
        self._counts["reads_submitted"] += np.bincount(layers, minlength=num_layers)
        for read in zip(layers.tolist(), experts.tolist(), slots.tolist()):
            self._start(*read)

    # ---- statistics ---------------------------------------------------------------------

    def stats(self) -> tuple[list[LayerStats], LayerStats]:
        """(per-layer counters, their sum)."""
        per_layer = [LayerStats(**{name: self._counts[name][layer].item() for name in _COUNTERS})
                     for layer in range(self.num_layers)]
        total = LayerStats()
        for layer_stats in per_layer:
            total.add(layer_stats)
        return per_layer, total
