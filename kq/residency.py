"""``kq.residency``: the residency manager, re-exported from :mod:`kq_host.residency`."""

from kq_host.arena import Arena, NumpyArena
from kq_host.residency import (
    FailedRead,
    LayerReport,
    LayerStats,
    ResidencyManager,
    SlotState,
)

__all__ = ["Arena", "FailedRead", "LayerReport", "LayerStats", "NumpyArena", "ResidencyManager", "SlotState"]
