"""The residency manager written plainly, one layer and one slot at a time: the reference the
vectorised ``kq_host.residency.ResidencyManager`` replays routing traces against (same victims,
same prestage order, same statistics and failures after every token). The record types, the argument
checks, the read queue's lifecycle and the thread guard are the package's own; only the bookkeeping is written here."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from kq_host.arena import Arena
from kq_host.prestage import prestage_order
from kq_host.residency import (MAX_BACKOFF_DOUBLINGS, FailedRead, LayerReport, LayerStats, Loader, ManagerBase,
                               PendingRead, SlotState, deadline_of)


@dataclass
class _Pending:
    layer: int
    expert: int
    slot: int
    future: Future


@dataclass
class _Layer:
    table: np.ndarray  # int32 [E], the live table (what the next snapshot copies)
    owner: np.ndarray  # int32 [S], expert in (or loading into) each slot, -1 free
    state: np.ndarray  # int8 [S], SlotState
    popularity: np.ndarray  # float64 [E], LFU credit
    last_used: np.ndarray  # int64 [E], LRU clock
    pinned: set[int] = field(default_factory=set)
    stats: LayerStats = field(default_factory=LayerStats)


class ReferenceManager(ManagerBase):
    """Per-layer slot tables, eviction policy, prestage reads and statistics, one layer at a time.

    Takes :class:`kq_host.residency.ResidencyManager`'s arguments.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *, loader: Loader,
                 arena: Arena | None = None, policy: Literal["lfu", "lru"] = "lfu",
                 pinned: Mapping[int, Iterable[int]] | None = None, keep_mass: float = 0.9,
                 read_budget: int | None = None, decay_interval: int = 64, queue_depth: int = 8,
                 bytes_per_expert: int = 0):
        super().__init__(num_layers, num_experts, num_slots, loader=loader, arena=arena, policy=policy,
                         pinned=pinned, keep_mass=keep_mass, read_budget=read_budget, decay_interval=decay_interval,
                         queue_depth=queue_depth, bytes_per_expert=bytes_per_expert)
        self.layers = [
            _Layer(table=np.full(num_experts, -1, np.int32), owner=np.full(num_slots, -1, np.int32),
                   state=np.zeros(num_slots, np.int8), popularity=np.zeros(num_experts),
                   last_used=np.full(num_experts, -1, np.int64))
            for _ in range(num_layers)
        ]
        for layer, experts in self.pinned_experts.items():
            self.layers[layer].pinned = set(experts)
        self._retry_after: dict[tuple[int, int], int] = {}  # (layer, expert) -> first token to read it again
        self._snapshot = self.snapshot()

    # ---- tables -------------------------------------------------------------------------

    def snapshot(self) -> np.ndarray:
        """A copy of every layer's table, ``int32 [L, E]``: what the next graph may use."""
        return np.stack([layer.table for layer in self.layers]).copy()

    def resident(self, layer: int) -> dict[int, int]:
        """``{expert: slot}`` published in ``layer``."""
        table = self.layers[layer].table
        return {int(e): int(table[e]) for e in np.flatnonzero(table >= 0)}

    def slot_owner(self, layer: int) -> np.ndarray:
        """``int32 [S]``: the expert resident in or loading into each slot, -1 free."""
        return self.layers[layer].owner.copy()

    # ---- loading ------------------------------------------------------------------------

    def _submit(self, layer: int, expert: int, slot: int) -> None:
        state = self.layers[layer]
        state.owner[slot] = expert
        state.state[slot] = SlotState.LOADING
        if self._pool is None:
            future: Future = Future()
            try:
                future.set_result(self.loader(layer, expert, slot))
            except BaseException as error:  # noqa: BLE001 - a failed read; published as one in (3)
                future.set_exception(error)
        else:
            future = self._pool.submit(self.loader, layer, expert, slot)
            future.add_done_callback(lambda _: self._notify_landed())
        self._pending.append(_Pending(layer, expert, slot, future))
        state.stats.reads_submitted += 1

    def pending(self) -> list[PendingRead]:
        """The reads submitted and not yet published."""
        return [PendingRead(read.layer, read.expert, read.slot) for read in self._pending]

    def _all_landed(self) -> bool:
        return all(read.future.done() for read in self._pending)

    def _publish_landed(self) -> None:
        """Publishes the reads done now."""
        still, interrupt = [], None
        for read in self._pending:
            if not read.future.done():
                still.append(read)
                continue
            state = self.layers[read.layer]
            try:
                payload = read.future.result()
                if self.arena is not None:
                    self.arena.write_slot(read.layer, read.slot, payload)
            except BaseException as error:  # noqa: BLE001 - reported; the slot stays unpublished and free
                state.owner[read.slot] = -1
                state.state[read.slot] = SlotState.FREE
                state.stats.reads_failed += 1
                self._record_failure(read, error)
                if isinstance(error, (KeyboardInterrupt, SystemExit)) and interrupt is None:
                    interrupt = error
                continue
            state.table[read.expert] = read.slot
            state.state[read.slot] = SlotState.RESIDENT
            state.stats.reads_landed += 1
            state.stats.bytes_read += payload if isinstance(payload, int) else self.bytes_per_expert
            self.failures.pop((read.layer, read.expert), None)
            self._retry_after.pop((read.layer, read.expert), None)
        self._pending = still
        if interrupt is not None:  # after the bookkeeping, so no later step sees this read again
            raise interrupt

    def _record_failure(self, read: _Pending, error: BaseException) -> None:
        key = (read.layer, read.expert)
        record = self.failures.get(key)
        count = 1 if record is None else record.count + 1
        self.failures[key] = FailedRead(read.layer, read.expert, read.slot, count, type(error).__name__, str(error),
                                        self.token)
        self._retry_after[key] = self.token + 2 ** min(count, MAX_BACKOFF_DOUBLINGS)

    def preload(self, layer: int, experts: Iterable[int], *, timeout: float | None = None) -> None:
        """Loads experts into free slots now and publishes those landed within ``timeout`` seconds (None: no
        limit; start-up, pinned sets).

        Raises:
            ValueError: ``layer``, an id of ``experts`` or ``timeout`` is out of range, or fewer slots are free
                than ``experts`` has ids not resident or loading (then nothing is claimed or read).
        """
        deadline = deadline_of("preload", timeout)
        layer, experts = self._preload_experts(layer, experts)
        with self._exclusive("preload"):
            state = self.layers[layer]
            wanted = [e for e in dict.fromkeys(experts) if state.table[e] < 0 and e not in state.owner]
            if len(wanted) > int((state.state == SlotState.FREE).sum()):
                raise ValueError(f"preload: layer {layer} has too few free slots for the experts {wanted}")
            for expert in wanted:
                self._submit(layer, expert, int(np.flatnonzero(state.state == SlotState.FREE)[0]))
            self._wait("preload", self._all_landed, deadline)
            self._publish_landed()
            self._snapshot = self.snapshot()

    def _victim(self, layer: int, shielded: set[int]) -> int | None:
        """The slot to evict: resident, not pinned, not routed this token, lowest priority."""
        state = self.layers[layer]
        candidates = [int(s) for s in np.flatnonzero(state.state == SlotState.RESIDENT)
                      if int(state.owner[s]) not in state.pinned and int(state.owner[s]) not in shielded]
        if not candidates:
            return None
        priority = state.popularity if self.policy == "lfu" else state.last_used
        # Lowest priority first; ties by lower expert id, so traces are reproducible.
        return min(candidates, key=lambda s: (priority[state.owner[s]], state.owner[s]))

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
        if len(reports) != self.num_layers:
            raise ValueError(f"step: expected {self.num_layers} layer reports, got {len(reports)}")
        # Every report is checked before anything is credited.
        orders = [prestage_order(report.miss_ids, report.miss_scores, self.num_experts) for report in reports]
        with self._exclusive("step"):
            if fence is not None:
                fence()  # (1)
            routed_sets = [self._credit(layer, report) for layer, report in enumerate(reports)]  # (2)
            self._publish_landed()  # (3)
            self._schedule(orders, routed_sets)  # (4) and (5)
            if self.decay_interval and self.token % self.decay_interval == self.decay_interval - 1:
                for state in self.layers:
                    state.popularity *= 0.5
            self.token += 1
            for state in self.layers:
                state.stats.reads_in_flight = 0
            for read in self._pending:
                self.layers[read.layer].stats.reads_in_flight += 1
            self._snapshot = self.snapshot()  # (6)
            return self._snapshot

    def _credit(self, layer: int, report: LayerReport) -> set[int]:
        state = self.layers[layer]
        ids = np.asarray(report.indices).reshape(-1).astype(np.int64)
        scores = np.asarray(report.scores, dtype=np.float64).reshape(-1)
        valid = (ids >= 0) & (ids < self.num_experts)
        kept = np.zeros(ids.shape, bool)
        missed = np.asarray(report.miss_ids).reshape(-1)
        kept[valid] = ~np.isin(ids[valid], missed[missed >= 0])  # served: not among the report's misses
        routed = ids[valid]
        np.add.at(state.popularity, routed, 1.0)
        state.last_used[routed] = self.token
        scores = np.where(np.isfinite(scores), scores, 0.0)
        shed_mass = float(np.sum(np.where(kept, 0.0, scores)))
        routed_mass = float(np.sum(scores))
        stats = state.stats
        stats.lookups += int(valid.sum())
        stats.hits += int(kept.sum())
        stats.misses += int((valid & ~kept).sum())
        stats.shed_count += int((~kept).sum())
        stats.shed_mass += shed_mass
        stats.routed_mass += routed_mass
        if shed_mass > (1.0 - self.keep_mass) * routed_mass:
            stats.over_budget += 1
        return {int(e) for e in routed}

    def _schedule(self, orders, routed_sets: Sequence[set[int]]) -> None:
        candidates = []
        for layer, order in enumerate(orders):
            state = self.layers[layer]
            for expert, score in zip(order.expert_ids.tolist(), order.best_scores.tolist()):
                if self._retry_after.get((layer, expert), 0) > self.token:
                    continue  # failed lately: backing off
                if state.table[expert] < 0 and expert not in state.owner:
                    candidates.append((-score if score == score else np.inf, layer, expert))
        candidates.sort()
        budget = len(candidates) if self.read_budget is None else self.read_budget
        for _, layer, expert in candidates[:budget]:
            state = self.layers[layer]
            free = np.flatnonzero(state.state == SlotState.FREE)
            if free.size:
                slot = int(free[0])
            else:
                slot = self._victim(layer, routed_sets[layer])
                if slot is None:
                    continue
                # (4) the victim leaves the table before any read targets its slot.
                state.table[state.owner[slot]] = -1
                state.owner[slot] = -1
                state.state[slot] = SlotState.FREE
                state.stats.evictions += 1
            self._submit(layer, expert, slot)  # (5)

    # ---- statistics ---------------------------------------------------------------------

    def stats(self) -> tuple[list[LayerStats], LayerStats]:
        """(per-layer counters, their sum)."""
        per_layer = [LayerStats(**{f.name: getattr(s.stats, f.name) for f in fields(LayerStats)})
                     for s in self.layers]
        total = LayerStats()
        for layer_stats in per_layer:
            total.add(layer_stats)
        return per_layer, total

