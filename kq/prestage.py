"""``kq.prestage``: the prestage order, re-exported from :mod:`kq_host.prestage`."""

from kq_host.prestage import PrestageOrder, prestage_order

__all__ = ["PrestageOrder", "prestage_order"]
