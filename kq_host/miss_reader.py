"""The host's side of misses read inside a program: the experts a layer missed, read while it waits.

A program that runs the exact rule with its misses fetched in place (``kq_jax.miss_fetch``) calls
:class:`MissReader` from inside the program when a layer misses; the reader reads the missed experts
through the store, several at a time, and hands them back stacked. The token's reports then name the
same misses, and the residency manager's loader (:meth:`MissReader.loader`) takes each from the
reads already made instead of reading it twice.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import numpy as np

from kq_core.validate import is_int


# The words that name each projection's role, in the order a program takes them: gate, up, down (Hugging Face's
# gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2).
ROLE_WORDS = (("gate", "w1"), ("up", "w3"), ("down", "w2"))


def _role(name) -> int | None:
    """The position of the role a projection's name says (:data:`ROLE_WORDS`), None where it says none."""
    words = set(re.split(r"[^a-z0-9]+", str(name).lower()))
    words |= {word.removesuffix("proj") for word in words}
    found = [role for role, names in enumerate(ROLE_WORDS) if words & set(names)]
    return found[0] if len(found) == 1 else None


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
        ValueError: ``projections`` empty or named in another order than gate, up, down (:data:`ROLE_WORDS`;
            names that say no role are taken as given), ``workers`` or ``keep`` below 1.

    A read that fails (the store raises, or its payload lacks a projection or differs in shape or dtype
    from the call's other experts) fails the call, naming the expert and layer; nothing of that call is
    kept, and the reader stays usable. The reader is safe to call from several threads at once (a
    program's callback and the manager's loader threads).
    """

    def __init__(self, store, projections: Sequence[str], *, workers: int = 8, keep: int = 4096, dtype=None):
        if not projections:
            raise ValueError("MissReader: projections must name at least one payload key")
        roles = [_role(name) for name in projections]
        if len(roles) == len(ROLE_WORDS) and None not in roles and roles != sorted(set(roles)):
            raise ValueError(f"MissReader: projections must be in the order the program takes them, gate, up, down "
                             f"(gate and up have one shape: a swap would run unnoticed), got {tuple(projections)}")
        for name, value in (("workers", workers), ("keep", keep)):
            if not is_int(value) or value < 1:
                raise ValueError(f"MissReader: {name} must be an int >= 1, got {value!r}")
        self._store, self._projections, self._keep = store, tuple(projections), keep
        self._dtype = None if dtype is None else np.dtype(dtype)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kq-miss")
        self._kept: dict[tuple[int, int], Mapping[str, np.ndarray]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.experts_read = 0  # experts read for programs waiting on them

    def __call__(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """The experts ``ids`` of ``layer``, read once each however often routed.

        Args:
            layer: the layer, an int >= 0.
            ids: int ``[m]``, m >= 1, the experts (ids >= 0), repeats allowed.

        Returns:
            Each projection's ``[m, out, in]``, in ``projections`` order, of the read's dtype (or ``dtype``).

        Raises:
            ValueError: ``layer`` or ``ids`` not as above; a payload that lacks a projection or differs in
                shape or dtype from the call's other experts (naming the expert and layer).
            RuntimeError: the reader is closed; the store's read failed (naming the expert and layer).
        """
        if not is_int(layer) or layer < 0:
            raise ValueError(f"MissReader: layer must be an int >= 0, got {layer!r}")
        layer = int(layer)
        array = np.asarray(ids)
        if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu" or (array < 0).any():
            raise ValueError(f"MissReader: ids must be a non-empty 1-D array of expert ids >= 0, got {ids!r}")
        if self._closed:
            raise RuntimeError("MissReader: the reader is closed; it reads no more misses")
        ids = [int(i) for i in array]
        distinct = list(dict.fromkeys(ids))
        try:
            reads = [self._pool.submit(self._read, layer, expert) for expert in distinct]
        except RuntimeError:
            raise RuntimeError("MissReader: the reader is closed; it reads no more misses") from None
        payloads = dict(zip(distinct, (read.result() for read in reads)))
        first = distinct[0]
        layout = self._layout(payloads[first])
        for expert, payload in payloads.items():
            for name, (shape, dtype) in self._layout(payload).items():
                if (shape, dtype) != layout[name]:
                    raise ValueError(f"MissReader: expert {expert} of layer {layer}: {name} is {dtype} {shape}, "
                                     f"expert {first}'s is {layout[name][1]} {layout[name][0]}")
        with self._lock:
            self.experts_read += len(distinct)
            for expert, payload in payloads.items():
                self._kept.pop((layer, expert), None)
                self._kept[(layer, expert)] = payload
            while len(self._kept) > self._keep:
                del self._kept[next(iter(self._kept))]
        stacked = (np.stack([payloads[e][name] for e in ids]) for name in self._projections)
        return tuple(stacked if self._dtype is None else (a.astype(self._dtype, copy=False) for a in stacked))

    def _read(self, layer: int, expert: int) -> Mapping[str, np.ndarray]:
        """The store's payload of one expert, checked to hold every projection."""
        try:
            payload = self._store.read_expert(layer, expert)
        except Exception as error:
            raise RuntimeError(f"MissReader: reading expert {expert} of layer {layer} failed: "
                               f"{type(error).__name__}: {error}") from error
        if not isinstance(payload, Mapping):
            raise ValueError(f"MissReader: expert {expert} of layer {layer}: the store's read_expert returned "
                             f"{type(payload).__name__}, not a mapping of projection to array")
        missing = [name for name in self._projections if name not in payload]
        if missing:
            raise ValueError(f"MissReader: expert {expert} of layer {layer}: the store's payload lacks "
                             f"{', '.join(missing)} (it has {', '.join(payload)})")
        return payload

    def _layout(self, payload: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Each projection's shape and dtype in ``payload``."""
        return {name: (np.shape(payload[name]), np.asarray(payload[name]).dtype) for name in self._projections}

    def loader(self, layer: int, expert: int, slot: int = 0) -> Mapping[str, np.ndarray]:
        """The residency manager's loader: the expert as a program's miss read it, else from the store."""
        with self._lock:
            payload = self._kept.pop((layer, expert), None)
        return self._store.read_expert(layer, expert) if payload is None else payload

    def close(self) -> None:
        """Waits for reads in flight and stops the reader's threads; later calls raise, :meth:`loader` still
        reads the store."""
        self._closed = True
        self._pool.shutdown(wait=True)
