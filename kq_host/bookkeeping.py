"""The residency manager's array bookkeeping, in NumPy: every layer's state as ``[L, E]`` and ``[L, S]``
arrays, and the three updates a token boundary makes to them.

:func:`credit` counts a token's routed entries (its hits from the tables it ran with, or from its report),
:func:`place` gives its missed experts slots (free ones first, then victims) and marks them loading,
:func:`publish` lands or frees the slots of finished reads.
Each works on the routed entries, the missed experts and their layers, never on every ``[L, E]``
entry. ``kq_host.bookkeeping_numba`` compiles the same three with Numba; both make the same
decisions as the plainly written reference manager in the tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np


class SlotState(enum.IntEnum):
    FREE = 0
    LOADING = 1
    RESIDENT = 2


FREE, LOADING, RESIDENT = SlotState.FREE.value, SlotState.LOADING.value, SlotState.RESIDENT.value


@dataclass
class Tables:
    """Every layer's residency state.

    Attributes:
        table: int32 ``[L, E]`` the live slot tables (-1: not resident).
        owner: int32 ``[L, S]`` the expert resident in or loading into each slot (-1: free).
        state: int8 ``[L, S]`` :class:`SlotState`.
        policy: ``"lfu"`` or ``"lru"``, what ``priority`` holds.
        priority: float64 ``[L, E]`` the eviction order, lowest first: LFU credit (one per routed
            entry, halved by :func:`decay`), or for LRU the last token that routed the expert (-1: none).
        pinned: bool ``[L, E]`` never evicted; held: bool ``[L, E]`` owns a slot (loading or resident).
        retry_after: int64 ``[L, E]`` the first token at which a failed expert is read again.
        counts: per-layer counters by name, each ``[L]`` (float64 for masses, int64 otherwise).
    """

    table: np.ndarray
    owner: np.ndarray
    state: np.ndarray
    policy: str
    priority: np.ndarray
    pinned: np.ndarray
    held: np.ndarray
    retry_after: np.ndarray
    counts: dict[str, np.ndarray]

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, num_slots: int, policy: str,
              counters: Sequence[str]) -> "Tables":
        shape_e, shape_s = (num_layers, num_experts), (num_layers, num_slots)
        return cls(table=np.full(shape_e, -1, np.int32), owner=np.full(shape_s, -1, np.int32),
                   state=np.zeros(shape_s, np.int8), policy=policy,
                   priority=np.full(shape_e, 0.0 if policy == "lfu" else -1.0), pinned=np.zeros(shape_e, bool),
                   held=np.zeros(shape_e, bool), retry_after=np.zeros(shape_e, np.int64),
                   counts={name: np.zeros(num_layers, np.float64 if name.endswith("mass") else np.int64)
                           for name in counters})


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


def credit(tables: Tables, ids: np.ndarray, scores: np.ndarray, snapshot: np.ndarray | None, token: int,
           keep_mass: float, *, miss_ids: np.ndarray | None = None) -> np.ndarray:
    """Priorities and the lookup and mass counters from a token's routed entries.

    Args:
        ids: int64 ``[L, n]`` routed expert ids (ids outside ``[0, E)`` count as shed, nothing else).
        scores: float64 ``[L, n]`` their scores (NaN or an infinity counts as no mass).
        snapshot: int32 ``[L, E]`` the tables the token ran with (an expert >= 0 there counts as a hit); None:
            the hits are those of the token's report, every valid entry whose expert is not among its layer's
            ``miss_ids`` (a pipelined loop runs a token on tables older than the last snapshot: its report
            says what it was served).
        keep_mass: a layer whose shed mass exceeds ``1 - keep_mass`` of its routed mass is over budget.
        miss_ids: int64 ``[L, m]`` the reported misses, -1 padded, the others in ``[0, E)`` (read only without
            a snapshot).

    Returns:
        bool ``[L, E]``: the experts the token routed.
    """
    if snapshot is None:
        snapshot = _reported_snapshot(tables.table.shape, miss_ids)
    num_layers, num_experts = snapshot.shape
    valid = (ids >= 0) & (ids < num_experts)
    flat_all = np.arange(num_layers)[:, None] * num_experts + np.where(valid, ids, 0)  # into the [L * E] arrays
    kept = valid & (snapshot.reshape(-1)[flat_all] >= 0)
    flat = flat_all[valid]  # layer-major, in entry order
    if tables.policy == "lfu":
        np.add.at(tables.priority.reshape(-1), flat, 1.0)
    else:
        tables.priority.reshape(-1)[flat] = token
    routed = np.zeros(snapshot.shape, bool)
    routed.reshape(-1)[flat] = True
    counts = tables.counts
    counts["lookups"] += valid.sum(axis=1)
    counts["hits"] += kept.sum(axis=1)
    counts["misses"] += (valid & ~kept).sum(axis=1)
    counts["shed_count"] += (~kept).sum(axis=1)
    numbers = np.where(np.isfinite(scores), scores, 0.0)
    shed_mass = np.where(kept, 0.0, numbers).sum(axis=1)
    routed_mass = numbers.sum(axis=1)
    counts["shed_mass"] += shed_mass
    counts["routed_mass"] += routed_mass
    counts["over_budget"] += shed_mass > (1.0 - keep_mass) * routed_mass
    return routed


def _reported_snapshot(shape: tuple[int, int], miss_ids: np.ndarray) -> np.ndarray:
    """int32 ``[L, E]``: the tables as a token's report shows them, -1 for each expert it reported missed."""
    num_layers, num_experts = shape
    served = np.zeros(num_layers * num_experts + 1, np.int32)  # the last entry takes the padding's writes
    flat = np.arange(0, num_layers * num_experts, num_experts)[:, None] + miss_ids
    served[np.where(miss_ids >= 0, flat, served.size - 1)] = -1
    return served[:-1].reshape(num_layers, num_experts)


def decay(tables: Tables) -> None:
    """Halves LFU credit (LRU keeps its clock)."""
    if tables.policy == "lfu":
        tables.priority *= 0.5


def claim(tables: Tables, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray) -> None:
    """Marks the slots loading for their experts (the reads about to be submitted)."""
    tables.owner[layers, slots] = experts
    tables.state[layers, slots] = LOADING
    tables.held[layers, experts] = True
    submitted = np.bincount(layers, minlength=tables.owner.shape[0])
    tables.counts["reads_submitted"] += submitted
    tables.counts["reads_in_flight"] += submitted


def place(tables: Tables, miss_ids: np.ndarray, miss_scores: np.ndarray, shielded: np.ndarray, *, token: int,
          read_budget: int | None, backing_off: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A token's missed experts, best first over all layers, each into a free slot or a victim's.

    Each missed expert counts once, by its best miss score (one missed only with NaN ranks last);
    those not holding a slot and not backing off are taken by best score, then lower layer, then lower
    id, up to ``read_budget``. Within its layer the r-th of them takes the r-th free slot (ascending),
    and past the free ones the next victim: a resident slot whose expert is neither pinned nor in
    ``shielded``, lowest priority first, ties by lower expert id.
    One that finds neither waits. Victims leave the tables; the chosen slots are :func:`claim` ed.

    Args:
        miss_ids: int64 ``[L, m]`` (-1 padded); miss_scores: float32 ``[L, m]``.
        shielded: bool ``[L, E]`` experts that may not be evicted this token (the routed ones).
        backing_off: False when no expert is backing off after failed reads (``retry_after`` is
            then not read).

    Returns:
        (layers, experts, slots): int64 ``[R]`` the reads to submit, in order.
    """
    num_layers, num_experts = tables.table.shape
    none = np.zeros(0, np.int64)
    real = miss_ids >= 0
    flat = (np.arange(num_layers)[:, None] * num_experts + miss_ids)[real]
    if flat.size == 0:
        return none, none, none
    # Each missed expert once, keyed by its best miss score (an expert missed only with NaN: +inf, last).
    scores = miss_scores[real]
    key = np.where(np.isnan(scores), np.inf, -scores.astype(np.float64))
    order = np.lexsort((key, flat))  # by expert, its best entry first
    flat, key = flat[order], key[order]
    first = np.ones(flat.size, bool)
    first[1:] = flat[1:] != flat[:-1]
    missed, key = flat[first], key[first]
    layers, experts = np.divmod(missed, num_experts)
    wanted = ~tables.held[layers, experts]
    if backing_off:
        wanted &= tables.retry_after[layers, experts] <= token
    if not wanted.any():
        return none, none, none
    candidates = missed[wanted]
    candidates = candidates[np.lexsort((candidates, key[wanted]))]
    if read_budget is not None:
        candidates = candidates[:read_budget]
    layers, experts = np.divmod(candidates, num_experts)
    per_layer = np.bincount(layers, minlength=num_layers)
    rank = _rank_within(layers, per_layer)
    present = per_layer > 0
    rows = np.flatnonzero(present)  # the layers with a candidate
    row_of = (np.cumsum(present) - 1)[layers]
    # Every row's free slots, ascending, row after row (nonzero runs row-major).
    free_row, free_slot = np.nonzero(tables.state[rows] == FREE)
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
        owner = tables.owner[short_rows]
        owners = np.maximum(owner, 0)
        layer_rows = short_rows[:, None]
        eligible = ((tables.state[short_rows] == RESIDENT) & ~tables.pinned[layer_rows, owners]
                    & ~shielded[layer_rows, owners])
        victim_at = np.full((rows.size, tables.owner.shape[1]), -1, np.int64)
        victim_at[short] = _ranked_slots(eligible, tables.priority[layer_rows, owners], owner)
        eligible_count = np.zeros(rows.size, np.int64)
        eligible_count[short] = eligible.sum(axis=1)
        victim_rank = rank - free_count
        victims &= victim_rank < eligible_count[row_of]
        slots[victims] = victim_at[row_of[victims], victim_rank[victims]]
    placed = slots >= 0
    layers, experts, slots, victims = layers[placed], experts[placed], slots[placed], victims[placed]
    # The victims leave the tables before any read targets their slots.
    evicted_layers, evicted_slots = layers[victims], slots[victims]
    evicted_experts = tables.owner[evicted_layers, evicted_slots]
    tables.table[evicted_layers, evicted_experts] = -1
    tables.held[evicted_layers, evicted_experts] = False
    tables.counts["evictions"] += np.bincount(evicted_layers, minlength=num_layers)
    claim(tables, layers, experts, slots)
    return layers, experts, slots


def publish(tables: Tables, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray, failed: np.ndarray,
            nbytes: np.ndarray, *, backing_off: bool = True) -> None:
    """Finished reads: a landed one's expert now points at its slot (and reads again at once, should it fail
    later); a failed one's slot is free again.

    Args:
        layers, experts, slots: int64 ``[R]`` the reads; failed: bool ``[R]``;
        nbytes: int64 ``[R]`` bytes each landed read counts (ignored where failed).
        backing_off: False when no expert is backing off after failed reads (``retry_after`` is then all 0,
            and not written).
    """
    num_layers = tables.table.shape[0]
    tables.counts["reads_in_flight"] -= np.bincount(layers, minlength=num_layers)
    if failed.any():
        tables.owner[layers[failed], slots[failed]] = -1
        tables.state[layers[failed], slots[failed]] = FREE
        tables.held[layers[failed], experts[failed]] = False
        tables.counts["reads_failed"] += np.bincount(layers[failed], minlength=num_layers)
    landed = ~failed
    if landed.any():
        layers, experts, slots = layers[landed], experts[landed], slots[landed]
        tables.table[layers, experts] = slots
        tables.state[layers, slots] = RESIDENT
        tables.counts["reads_landed"] += np.bincount(layers, minlength=num_layers)
        np.add.at(tables.counts["bytes_read"], layers, nbytes[landed])  # in int64: counts past 2**53 stay exact
        if backing_off:
            tables.retry_after[layers, experts] = 0
