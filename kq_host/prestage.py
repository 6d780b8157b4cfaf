"""The host's prestage list: which experts to read next, in what order."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def int64_ids(where: str, name: str, values) -> np.ndarray:
    """``values`` (expert ids) as an int64 array; ValueError naming ``name`` unless they are integers that
    int64 holds (float ids would be truncated, a uint64 past 2**63 - 1 would wrap to a negative one)."""
    array = np.asarray(values)
    if array.size == 0:  # no ids (an empty list is float64 to NumPy)
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{where}: {name} must be integers, got dtype {array.dtype}")
    if array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}: {name} holds {int(array.max())}, past int64")
    return array.astype(np.int64, copy=False)


class PrestageOrder(NamedTuple):
    """Deduplicated misses of a batch.

    Attributes:
        expert_ids: int32 ``[M]`` every expert that missed in any row, once.
        counts: int32 ``[M]`` in how many (row, k) entries it missed.
        best_scores: float32 ``[M]`` its highest miss score.
    """

    expert_ids: np.ndarray
    counts: np.ndarray
    best_scores: np.ndarray


def prestage_order(miss_ids, miss_scores, num_experts: int) -> PrestageOrder:
    """Orders a batch's misses for prestaging.

    Every expert id that missed in any row appears once, ordered by its highest
    miss score, descending; ties by lower id. A NaN score ranks below every
    number (as in ``route_shed``'s own miss order), so an expert whose only
    misses are NaN comes after all others. Padding (id -1, from the miss lists'
    tails) is ignored.

    Args:
        miss_ids: int ``[..., K]`` as ``route_shed`` returns them (-1 padded).
        miss_scores: float ``[..., K]``, same shape.
        num_experts: E; every non-padding id must lie in ``[0, E)``.

    Returns:
        :class:`PrestageOrder`.

    Raises:
        ValueError: shapes differ, the ids are no integers, or an id is outside ``[-1, E)``.
    """
    ids = int64_ids("prestage_order", "miss_ids", miss_ids).reshape(-1)
    scores = np.asarray(miss_scores).reshape(-1).astype(np.float32)
    if np.asarray(miss_ids).shape != np.asarray(miss_scores).shape:
        raise ValueError(f"prestage_order: miss_scores must have the shape of miss_ids "
                         f"{np.shape(miss_ids)}, got {np.shape(miss_scores)}")
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
        raise ValueError(f"prestage_order: miss_ids holds {ids[bad][0]}, outside [-1, {num_experts})")
    real = ids >= 0
    ids, scores = ids[real], scores[real]
    counts = np.bincount(ids, minlength=num_experts)
    best = np.full(num_experts, -np.inf, np.float32)
    numbers = ~np.isnan(scores)
    np.maximum.at(best, ids[numbers], scores[numbers])
    missed = np.flatnonzero(counts)
    only_nan = ~(np.bincount(ids[numbers], minlength=num_experts) > 0)[missed]
    # Sort keys, last one primary: NaN-only experts last, then descending best score, then id.
    order = np.lexsort((missed, -best[missed], only_nan))
    chosen = missed[order]
    best_scores = np.where(only_nan[order], np.float32(np.nan), best[chosen])
    return PrestageOrder(chosen.astype(np.int32), counts[chosen].astype(np.int32), best_scores.astype(np.float32))
