"""The host side of an expert arena, in NumPy (Numba, where installed, compiles the step's bookkeeping):
what is resident, what to read next, and the reads.

:class:`~kq_host.residency.ResidencyManager` keeps the per-layer slot tables
and runs the token-boundary step; :func:`~kq_host.prestage.prestage_order`
ranks a token's misses; :class:`~kq_host.expert_store.ExpertStore` reads one
expert at a time from safetensors files; :mod:`kq_host.checkpoint` reads a
checkpoint directory's config and its experts, float or mlx-community's
quantized layout (:func:`~kq_host.checkpoint.open_experts`);
:class:`~kq_host.arena.NumpyArena`
holds experts in host memory (the JAX and MLX arenas are in ``kq_jax`` and
``kq_mlx``).
"""

from kq_host.arena import Arena, NumpyArena
from kq_host.expert_store import ExpertStore, ExpertStoreClosed, ExpertStoreError
from kq_host.prestage import PrestageOrder, prestage_order
from kq_host.residency import (FailedRead, LayerReport, LayerStats, ManagerClosed, PreloadError,
                               ResidencyManager)

__all__ = ["Arena", "ExpertStore", "ExpertStoreClosed", "ExpertStoreError", "FailedRead", "LayerReport",
           "LayerStats", "ManagerClosed", "NumpyArena", "PreloadError", "PrestageOrder", "ResidencyManager",
           "prestage_order"]
