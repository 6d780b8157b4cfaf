"""A literal, one-element-at-a-time transcription of the contract.

Deliberately written without any of the oracle's vectorisation so that the two
can be checked against each other.
"""

import numpy as np

TINY = np.float32(2.0**-126)
NAN = np.uint32(0x7FC00000).view(np.float32)


def flush(x):
    x = np.float32(x)
    return np.float32(0.0) if abs(x) < TINY else x


def route_shed_row(ids, scores, table, tier_base=None):
    top_k = len(ids)
    s = [flush(np.float32(v)) for v in scores]
    slot = []
    for e in ids:
        e = int(e)
        slot.append(int(table[e]) if 0 <= e < len(table) else -1)
    keep = [v >= 0 for v in slot]
    total = np.float32(0.0)
    kept = np.float32(0.0)
    with np.errstate(all="ignore"):
        for k in range(top_k):
            total = flush(total + s[k])
            if keep[k]:
                kept = flush(kept + s[k])
        scale = flush(total / kept) if kept > np.float32(0.0) else np.float32(0.0)
        first = next((slot[k] for k in range(top_k) if keep[k]), 0)
        slots = [slot[k] if keep[k] else first for k in range(top_k)]
        mix = [flush(s[k] * scale) if keep[k] else np.float32(0.0) for k in range(top_k)]
    misses = [k for k in range(top_k) if not keep[k] and 0 <= int(ids[k]) < len(table)]
    if tier_base is not None:  # on_miss="tier": misses served past the arena, nothing rescaled
        for k in range(top_k):
            if keep[k] or k in misses:
                mix[k] = s[k]
            if k in misses:
                slots[k] = tier_base + int(ids[k])
    misses.sort(key=lambda k: (bool(np.isnan(s[k])), 0.0 if np.isnan(s[k]) else -float(s[k]), k))
    miss_ids = [int(ids[k]) for k in misses] + [-1] * (top_k - len(misses))
    miss_scores = [s[k] for k in misses] + [np.float32(0.0)] * (top_k - len(misses))
    canon = lambda v: NAN if np.isnan(v) else v  # noqa: E731
    return slots, [canon(v) for v in mix], miss_ids, [canon(v) for v in miss_scores]


def route_shed_scalar(indices, scores, table, tier_base=None):
    top_k = indices.shape[-1]
    ids = indices.reshape(-1, top_k)
    sc = scores.reshape(-1, top_k).astype(np.float32)
    rows = [route_shed_row(ids[r], sc[r], table, tier_base) for r in range(ids.shape[0])]
    shape = indices.shape
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    return (
        np.array(cols[0], np.int64).astype(indices.dtype).reshape(shape),
        np.array(cols[1], np.float32).reshape(shape),
        np.array(cols[2], np.int32).reshape(shape),
        np.array(cols[3], np.float32).reshape(shape),
    )
