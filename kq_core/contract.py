"""The names and numbers every implementation of ``route_shed`` shares.

One result type per op for every backend (NumPy, JAX and MLX arrays fill the
same named tuples), the dtypes the op takes, and the constants of the
contract. ``K`` (the routed entries per row) is called ``top_k`` in code
everywhere: the router's top-k is what a row holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

MAX_TOP_K = 64
INDEX_DTYPES = ("int32", "uint32")
SCORE_DTYPES = ("float32", "bfloat16", "float16")
SLOT_TABLE_DTYPES = ("int32",)
# One expert's SwiGLU projections, in the order every arena, tier and store of kq keeps them.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# What route_shed does with a routed expert that is not resident: drop it and rescale the kept
# weights ("shed"), or serve it from the low-precision tier that holds every expert ("tier").
ROUTE_SHED_ON_MISS = ("shed", "tier")
# topk_route_shed can also serve a miss by the best resident expert the row did not choose.
ON_MISS = ("shed", "substitute", "tier")
# The NumPy dtype of each name above (bfloat16 from ml_dtypes).
NUMPY_DTYPES = {name: np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
                for name in (*INDEX_DTYPES, *SCORE_DTYPES)}

F32_MIN_NORMAL = 2.0**-126
# Every NaN the op writes has these bits (a quiet NaN, sign clear, no payload).
CANONICAL_NAN_BITS = 0x7FC00000
# Miss order keys: an int32 whose ascending order is descending score. A NaN
# score's key sits above every number's, and an entry that is not a miss
# carries a key above that.
NAN_ORDER_KEY = 0x7F800002
NOT_A_MISS_KEY = 0x7F800003


class RouteShedResult(NamedTuple):
    """The four outputs of ``route_shed``, each shaped like ``indices`` ``[..., K]``.

    The arrays are of the framework that computed them (NumPy, JAX or MLX).

    Attributes:
        slots: arena slot per entry, dtype of ``indices`` (uint32 from an mlx-lm
            router, ready for ``gather_mm(..., rhs_indices=slots)``); a shed
            entry holds the row's first kept slot (0 if none). With
            ``on_miss="tier"`` a miss holds ``num_slots + id``: past the arena's
            S slots, its expert's place in the tier.
        mix: float32 gate weight per entry, 0.0 for shed entries.
        miss_ids: int32 ids of shed, valid experts, front-packed by descending
            score, -1 padded.
        miss_scores: float32 scores of those misses, +0.0 padded.
    """

    slots: Any
    mix: Any
    miss_ids: Any
    miss_scores: Any


class TopkRouteShedResult(NamedTuple):
    """Outputs of ``topk_route_shed``: the routing, and ``route_shed`` of it.

    Attributes:
        indices: int32 ``[..., top_k]`` each row's top-k expert ids, best first.
        scores: float32 ``[..., top_k]`` their values renormalised over the top-k.
        shed: :class:`RouteShedResult` of ``route_shed(indices, scores, slot_table)``.
    """

    indices: Any
    scores: Any
    shed: RouteShedResult


def holds_every_expert(slot_tables, num_slots: int) -> np.ndarray:
    """Which slot tables cannot miss: every expert has a slot in ``[0, num_slots)``.

    Args:
        slot_tables: int ``[..., E]`` host tables (-1 = not resident), one per layer or row.
        num_slots: S, the arena's slots (an entry at or past it is not resident).

    Returns:
        bool ``[...]``: True where the table holds all E experts (an empty table holds none).
    """
    tables = np.asarray(slot_tables)
    if tables.ndim == 0:
        raise ValueError("holds_every_expert: slot_tables must be [..., E], got a scalar")
    return ((tables >= 0) & (tables < num_slots)).all(axis=-1) & (tables.shape[-1] > 0)
