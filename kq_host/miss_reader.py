"""The host's side of misses read inside a program: the experts a layer missed, read while it waits.

A program that runs the exact rule with its misses fetched in place (``kq_jax.miss_fetch``) calls
:class:`MissReader` from inside the program when a layer misses; the reader reads the missed experts
through the store, several at a time, and hands them back stacked. The token's reports then name the
same misses, and the residency manager's loader (:meth:`MissReader.loader`) takes each from the
reads already made instead of reading it twice.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import numpy as np


class MissReader:
    """Reads the experts a layer missed, for a program waiting on them, and keeps them for the arena.

    Args:
        store: anything with ``read_expert(layer, expert) -> {projection: array}``
            (:class:`~kq_host.expert_store.ExpertStore`).
        projections: the payload keys in the order the program takes them (gate, up, down).
        workers: reads in flight at once.
        keep: at most this many experts kept for :meth:`loader` (the oldest dropped first).
        dtype: the dtype the program's arena holds (e.g. float32 for a bfloat16 checkpoint), each read
            converted to it for the program (the kept reads stay as read); None: as read.

    Raises:
        ValueError: ``projections`` empty, ``workers`` or ``keep`` below 1.
    """

    def __init__(self, store, projections: Sequence[str], *, workers: int = 8, keep: int = 4096, dtype=None):
        if not projections:
            raise ValueError("MissReader: projections must name at least one payload key")
        for name, value in (("workers", workers), ("keep", keep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MissReader: {name} must be an int >= 1, got {value!r}")
        self._store, self._projections, self._keep = store, tuple(projections), keep
        self._dtype = None if dtype is None else np.dtype(dtype)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kq-miss")
        self._kept: dict[tuple[int, int], Mapping[str, np.ndarray]] = {}
        self._lock = threading.Lock()
        self.experts_read = 0  # experts read for programs waiting on them

    def __call__(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """The experts ``ids`` (int ``[m]``) of ``layer``, each projection stacked ``[m, out, in]``, in
        ``projections`` order; an id routed twice read once."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        distinct = list(dict.fromkeys(ids))
        payloads = dict(zip(distinct, self._pool.map(lambda e: self._store.read_expert(layer, e), distinct)))
        with self._lock:
            self.experts_read += len(distinct)
            for expert, payload in payloads.items():
                self._kept.pop((layer, expert), None)
                self._kept[(layer, expert)] = payload
            while len(self._kept) > self._keep:
                del self._kept[next(iter(self._kept))]
        stacked = (np.stack([payloads[e][name] for e in ids]) for name in self._projections)
        return tuple(stacked if self._dtype is None else (a.astype(self._dtype, copy=False) for a in stacked))

    def loader(self, layer: int, expert: int, slot: int = 0) -> Mapping[str, np.ndarray]:
        """The residency manager's loader: the expert as a program's miss read it, else from the store."""
        with self._lock:
            payload = self._kept.pop((layer, expert), None)
        return self._store.read_expert(layer, expert) if payload is None else payload

    def close(self) -> None:
        """Waits for reads in flight and stops the reader's threads."""
        self._pool.shutdown(wait=True)
