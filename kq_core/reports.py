"""The packed report: every MoE layer's routing and misses for a token, in one int32 array.

A decode step builds it in its graph so the host reads a token's reports back in one transfer; the
JAX step (``kq_jax.arena.pack_reports``), the mlx-lm adapter (``kq_mlx.report_pack``) and the study
all pack this layout, and :func:`unpack` (through ``kq_host.residency.LayerReport.from_packed``) is
the one decoder.

Layout: int32 ``[F, L, T, K]``, field-major, the fields in :data:`REPORT_FIELDS` order:

* ``ids``: the routed expert ids;
* ``scores``: their router scores, as float32 bits;
* ``miss_ids``: ``route_shed``'s miss list, highest score first, ``-1`` padded;
* ``miss_scores``: the misses' scores, float32 bits, ``+0.0`` padded;
* ``served``: each routed entry's score where its expert (or a stand-in: a substitute, its tier copy)
  was computed, ``+0.0`` where it was shed; float32 bits.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

REPORT_FIELDS = ("ids", "scores", "miss_ids", "miss_scores", "served")
# Fields stored as float32 bits; the others as int32 values.
FLOAT_FIELDS = frozenset({"scores", "miss_scores", "served"})


def pack(fields: Mapping[str, np.ndarray]) -> np.ndarray:
    """``{field: [L, T, K]}`` (every field of :data:`REPORT_FIELDS`, one shape) -> int32 ``[F, L, T, K]``.

    Float fields are converted to float32 (exactly, from bfloat16 or float16) and stored as their bits.

    Raises:
        ValueError: a field is missing, or the fields' shapes differ or are not ``[L, T, K]``.
    """
    missing = [name for name in REPORT_FIELDS if name not in fields]
    if missing:
        raise ValueError(f"pack: fields {missing} missing; a report has {REPORT_FIELDS}")
    arrays = [np.asarray(fields[name]) for name in REPORT_FIELDS]
    shapes = {name: a.shape for name, a in zip(REPORT_FIELDS, arrays)}
    if len(set(shapes.values())) != 1 or arrays[0].ndim != 3:
        raise ValueError(f"pack: every field must be [L, T, K] of one shape, got {shapes}")
    return np.stack([np.ascontiguousarray(a.astype(np.float32)).view(np.int32) if name in FLOAT_FIELDS
                     else a.astype(np.int32) for name, a in zip(REPORT_FIELDS, arrays)])


def unpack(packed: np.ndarray) -> dict[str, np.ndarray]:
    """int32 ``[F, L, T, K]`` -> ``{field: [L, T, K]}``: ids int32, scores float32 (views, no copy).

    Raises:
        ValueError: ``packed`` is not int32 ``[F, L, T, K]`` with ``F = len(REPORT_FIELDS)``.
    """
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.ndim != 4 or packed.shape[0] != len(REPORT_FIELDS):
        raise ValueError(f"packed must be int32 [{len(REPORT_FIELDS)}, L, T, K] (fields {REPORT_FIELDS}), "
                         f"got {packed.dtype} {packed.shape}")
    return {name: packed[i].view(np.float32) if name in FLOAT_FIELDS else packed[i]
            for i, name in enumerate(REPORT_FIELDS)}
