"""The residency manager's array bookkeeping compiled with Numba: :mod:`kq_host.bookkeeping`'s
:func:`credit`, :func:`place` and :func:`publish`, written as loops over the routed entries, the
missed experts and their layers' slots, with the same decisions.

Imported only when a manager asks for it (``impl="numba"``, or ``"auto"`` with Numba installed). The
kernels are compiled at their first call and cached on disk (``NUMBA_CACHE_DIR`` chooses where).
"""

from __future__ import annotations

import numba
import numpy as np

from kq_host.bookkeeping import FREE, LOADING, RESIDENT, Tables

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _run_sum(values, start, stop):
    """NumPy's sum of a run of at most 128: eight running sums (under 8 values, one), kept in registers."""
    count = stop - start
    if count < 8:
        total = -0.0
        for i in range(start, stop):
            total += values[i]
        return total
    r0, r1, r2, r3 = values[start], values[start + 1], values[start + 2], values[start + 3]
    r4, r5, r6, r7 = values[start + 4], values[start + 5], values[start + 6], values[start + 7]
    i = start + 8
    end = stop - count % 8
    while i < end:
        r0 += values[i]
        r1 += values[i + 1]
        r2 += values[i + 2]
        r3 += values[i + 3]
        r4 += values[i + 4]
        r5 += values[i + 5]
        r6 += values[i + 6]
        r7 += values[i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < stop:
        total += values[i]
        i += 1
    return total


@_jit
def _numpy_sum(values):
    """``values.sum()`` as NumPy adds a contiguous float64 array: runs of up to 128 by
    :func:`_run_sum`, longer ones split in halves (a multiple of 8 first) and the halves' sums added.
    Written with an explicit stack, since Numba's disk cache cannot hold a recursive function."""
    if values.size <= 128:
        return 0.0 + _run_sum(values, 0, values.size)  # NumPy's reduction starts from the identity
    depth = 192
    starts, stops, combine = np.empty(depth, np.int64), np.empty(depth, np.int64), np.empty(depth, np.bool_)
    sums = np.empty(depth, np.float64)
    top, done = 1, 0
    starts[0], stops[0], combine[0] = 0, values.size, False
    while top:
        top -= 1
        start, stop = starts[top], stops[top]
        if combine[top]:  # both halves are summed: add them
            done -= 1
            sums[done - 1] += sums[done]
        elif stop - start <= 128:
            sums[done] = _run_sum(values, start, stop)
            done += 1
        else:
            half = (stop - start) // 2
            half -= half % 8
            # Popped in reverse: the left half, the right half, then their sum.
            starts[top], stops[top], combine[top] = start, stop, True
            starts[top + 1], stops[top + 1], combine[top + 1] = start + half, stop, False
            starts[top + 2], stops[top + 2], combine[top + 2] = start, start + half, False
            top += 3
    return 0.0 + sums[0]


@_jit
def _credit_entries(ids, scores, missed, token, lfu, keep_mass, priority, routed, lookups, hits, misses, shed_count,
                    shed_mass, routed_mass, over_budget):
    """The credit of the routed entries, ``missed[layer, j]`` telling whether entry j of the layer was shed
    as a miss (read only where its id is a valid expert)."""
    num_layers, entries = ids.shape
    num_experts = priority.shape[1]
    numbers = np.empty(entries, np.float64)
    shed_numbers = np.empty(entries, np.float64)
    for layer in range(num_layers):
        for j in range(entries):
            score = scores[layer, j]
            numbers[j] = score if np.isfinite(score) else 0.0
            shed_numbers[j] = numbers[j]
            expert = ids[layer, j]
            if expert < 0 or expert >= num_experts:
                shed_count[layer] += 1
                continue
            if lfu:
                priority[layer, expert] += 1.0
            else:
                priority[layer, expert] = token
            routed[layer, expert] = True
            lookups[layer] += 1
            if not missed[layer, j]:
                shed_numbers[j] = 0.0
                hits[layer] += 1
            else:
                misses[layer] += 1
                shed_count[layer] += 1
        shed = _numpy_sum(shed_numbers)
        total = _numpy_sum(numbers)
        shed_mass[layer] += shed
        routed_mass[layer] += total
        if shed > (1.0 - keep_mass) * total:
            over_budget[layer] += 1


@_jit
def _missed_in_snapshot(ids, snapshot):
    """bool ``[L, n]``: each routed entry's expert not resident in ``snapshot`` (False where its id is invalid)."""
    num_layers, entries = ids.shape
    num_experts = snapshot.shape[1]
    missed = np.zeros(ids.shape, np.bool_)
    for layer in range(num_layers):
        for j in range(entries):
            expert = ids[layer, j]
            if 0 <= expert < num_experts:
                missed[layer, j] = snapshot[layer, expert] < 0
    return missed


@_jit
def _missed_in_reports(ids, miss_ids, num_experts):
    """bool ``[L, n]``: each routed entry's expert among its layer's reported misses (``miss_ids`` ``[L, m]``,
    -1 padded, every other id in ``[0, E)``)."""
    num_layers, entries = ids.shape
    missed = np.zeros(ids.shape, np.bool_)
    reported = np.zeros(num_experts, np.bool_)
    for layer in range(num_layers):
        for j in range(miss_ids.shape[1]):
            if miss_ids[layer, j] >= 0:
                reported[miss_ids[layer, j]] = True
        for j in range(entries):
            expert = ids[layer, j]
            if 0 <= expert < num_experts:
                missed[layer, j] = reported[expert]
        for j in range(miss_ids.shape[1]):
            if miss_ids[layer, j] >= 0:
                reported[miss_ids[layer, j]] = False
    return missed


@_jit
def _candidates(miss_ids, miss_scores, token, read_budget, held, retry_after, backing_off):
    """The missed experts to read, as flat ``layer * E + expert`` ids in read order.

    Every miss entry becomes one sortable integer: its score's order (higher first, NaN and -inf
    last, signed zeros equal) above its flat id. One sort orders the entries by (score, layer, id);
    an expert's first entry is its best.
    """
    num_layers, width = miss_ids.shape
    num_experts = held.shape[1]
    entries = np.empty(num_layers * width, np.uint64)
    count = 0
    for layer in range(num_layers):
        for j in range(width):
            expert = miss_ids[layer, j]
            if expert < 0:
                continue
            score = miss_scores[layer, j]
            if np.isnan(score) or score == -np.inf:
                order = np.uint64(0xFFFFFFFF)
            else:
                bits = np.uint64(np.float32(score + np.float32(0.0)).view(np.uint32))  # -0.0 + 0.0 is 0.0
                ascending = (bits ^ np.uint64(0xFFFFFFFF)) if bits >> np.uint64(31) else (bits | np.uint64(0x80000000))
                order = np.uint64(0xFFFFFFFF) - ascending  # descending score
            entries[count] = (order << np.uint64(32)) | np.uint64(layer * num_experts + expert)
            count += 1
    entries = np.sort(entries[:count])
    limit = count if read_budget < 0 else read_budget
    seen = np.zeros(num_layers * num_experts, np.bool_)
    chosen = np.empty(count, np.int64)
    taken = 0
    for entry in entries:
        if taken == limit:
            break
        flat = np.int64(entry & np.uint64(0xFFFFFFFF))
        if seen[flat]:
            continue  # the expert's best entry came first
        seen[flat] = True
        layer, expert = flat // num_experts, flat % num_experts
        if not held[layer, expert] and not (backing_off and retry_after[layer, expert] > token):
            chosen[taken] = flat
            taken += 1
    return chosen[:taken]


@_jit
def _place(candidates, shielded, priority, table, owner, state, pinned, held, evictions, submitted, in_flight):
    num_layers, num_experts = table.shape
    num_slots = owner.shape[1]
    # Each layer's slots for its candidates, in the order they are taken: free ones ascending, then
    # victims by ascending (priority, expert id). One pass over a layer's slots finds both.
    need = np.zeros(num_layers, np.int64)
    for flat in candidates:
        need[flat // num_experts] += 1
    start = np.zeros(num_layers + 1, np.int64)
    for layer in range(num_layers):
        start[layer + 1] = start[layer] + need[layer]
    offered = np.full(candidates.size, -1, np.int64)
    found = np.zeros(num_layers, np.int64)
    keys = np.empty(candidates.size, np.float64)  # the victims' priorities, kept sorted per layer
    for layer in range(num_layers):
        wanted = need[layer]
        if wanted == 0:
            continue
        base = start[layer]
        free = 0
        for s in range(num_slots):
            if free < wanted and state[layer, s] == FREE:
                offered[base + free] = s
                free += 1
        victims = 0
        if free < wanted:
            # Resident experts by id (their table entries point at their slots), so an equal
            # priority never displaces an earlier one: ties go to the lower id.
            first = base + free
            room = wanted - free
            worst = np.inf  # the key a resident expert must beat to get in: +inf until the room is full
            for expert in range(num_experts):
                slot = table[layer, expert]
                eligible = (slot >= 0) & ~pinned[layer, expert] & ~shielded[layer, expert]
                key = priority[layer, expert] if eligible else np.inf
                if key >= worst:
                    continue
                if victims < room:
                    at = first + victims
                    victims += 1
                else:  # full: the highest key drops out
                    at = first + room - 1
                while at > first and key < keys[at - 1]:
                    keys[at], offered[at] = keys[at - 1], offered[at - 1]
                    at -= 1
                keys[at], offered[at] = key, slot
                if victims == room:
                    worst = keys[first + room - 1]
        found[layer] = free + victims
    # The candidates in order, each taking its layer's next offered slot; past the offers one waits.
    reads = np.empty((3, candidates.size), np.int64)
    count = 0
    taken = np.zeros(num_layers, np.int64)
    for flat in candidates:
        layer, expert = flat // num_experts, flat % num_experts
        if taken[layer] == found[layer]:
            continue  # no free slot and no victim left in this layer: the expert waits
        slot = offered[start[layer] + taken[layer]]
        taken[layer] += 1
        if state[layer, slot] == RESIDENT:  # a victim leaves the table before any read targets its slot
            evicted = owner[layer, slot]
            table[layer, evicted] = -1
            held[layer, evicted] = False
            evictions[layer] += 1
        owner[layer, slot] = expert
        state[layer, slot] = LOADING
        held[layer, expert] = True
        submitted[layer] += 1
        in_flight[layer] += 1
        reads[0, count], reads[1, count], reads[2, count] = layer, expert, slot
        count += 1
    return reads[:, :count]


@_jit
def _publish(layers, experts, slots, failed, nbytes, backing_off, table, owner, state, held, retry_after,
             landed_count, failed_count, bytes_read, in_flight):
    for i in range(layers.size):
        layer, expert, slot = layers[i], experts[i], slots[i]
        in_flight[layer] -= 1
        if failed[i]:
            owner[layer, slot] = -1
            state[layer, slot] = FREE
            held[layer, expert] = False
            failed_count[layer] += 1
        else:
            table[layer, expert] = slot
            state[layer, slot] = RESIDENT
            landed_count[layer] += 1
            bytes_read[layer] += nbytes[i]
            if backing_off:
                retry_after[layer, expert] = 0


@_jit
def _credit_from_snapshot(ids, scores, snapshot, token, lfu, keep_mass, priority, lookups, hits, misses, shed_count,
                          shed_mass, routed_mass, over_budget):
    routed = np.zeros(priority.shape, np.bool_)
    _credit_entries(ids, scores, _missed_in_snapshot(ids, snapshot), token, lfu, keep_mass, priority, routed, lookups,
                    hits, misses, shed_count, shed_mass, routed_mass, over_budget)
    return routed


@_jit
def _credit_from_reports(ids, scores, miss_ids, token, lfu, keep_mass, priority, lookups, hits, misses, shed_count,
                         shed_mass, routed_mass, over_budget):
    routed = np.zeros(priority.shape, np.bool_)
    _credit_entries(ids, scores, _missed_in_reports(ids, miss_ids, priority.shape[1]), token, lfu, keep_mass,
                    priority, routed, lookups, hits, misses, shed_count, shed_mass, routed_mass, over_budget)
    return routed


@_jit
def _place_misses(miss_ids, miss_scores, token, read_budget, backing_off, shielded, priority, table, owner, state,
                  pinned, held, retry_after, evictions, submitted, in_flight):
    candidates = _candidates(miss_ids, miss_scores, token, read_budget, held, retry_after, backing_off)
    return _place(candidates, shielded, priority, table, owner, state, pinned, held, evictions, submitted, in_flight)


# Each function below is one compiled call: a call's dispatch costs far more when the step's other work has
# taken the caches than when it repeats.


def credit(tables: Tables, ids: np.ndarray, scores: np.ndarray, snapshot: np.ndarray | None, token: int,
           keep_mass: float, *, miss_ids: np.ndarray | None = None) -> np.ndarray:
    """:func:`kq_host.bookkeeping.credit`, compiled."""
    counts = tables.counts
    return (_credit_from_reports if snapshot is None else _credit_from_snapshot)(
        ids, scores, miss_ids if snapshot is None else snapshot, token, tables.policy == "lfu", keep_mass,
        tables.priority, counts["lookups"], counts["hits"], counts["misses"], counts["shed_count"],
        counts["shed_mass"], counts["routed_mass"], counts["over_budget"])


def place(tables: Tables, miss_ids: np.ndarray, miss_scores: np.ndarray, shielded: np.ndarray, *, token: int,
          read_budget: int | None, backing_off: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`kq_host.bookkeeping.place`, compiled."""
    counts = tables.counts
    reads = _place_misses(miss_ids, miss_scores, token, -1 if read_budget is None else read_budget, backing_off,
                          shielded, tables.priority, tables.table, tables.owner, tables.state, tables.pinned,
                          tables.held, tables.retry_after, counts["evictions"], counts["reads_submitted"],
                          counts["reads_in_flight"])
    return reads[0], reads[1], reads[2]


def publish(tables: Tables, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray, failed: np.ndarray,
            nbytes: np.ndarray, *, backing_off: bool = True) -> None:
    """:func:`kq_host.bookkeeping.publish`, compiled."""
    counts = tables.counts
    _publish(layers, experts, slots, failed, nbytes, backing_off, tables.table, tables.owner, tables.state, tables.held,
             tables.retry_after, counts["reads_landed"], counts["reads_failed"], counts["bytes_read"],
             counts["reads_in_flight"])
