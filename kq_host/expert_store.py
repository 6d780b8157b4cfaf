"""Reads single experts out of safetensors checkpoints, without reading the rest.

Two layouts are in the wild and both are supported:

* one tensor per expert and projection, e.g.
  ``model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight`` (Qwen3-MoE,
  Mixtral, DeepSeek checkpoints on the Hub);
* stacked tensors ``[E, ...]`` per layer and projection, e.g.
  ``model.layers.{layer}.mlp.experts.gate_proj`` (converted / MLX checkpoints),
  from which one expert is a contiguous byte range.

The safetensors header is parsed here (8-byte little-endian length, JSON, then
the data) and each projection is read with one ``os.pread`` of exactly its
bytes, so a thread pool of ``queue_depth`` readers keeps an SSD's queue full.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat as stat_kinds
import struct
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

import ml_dtypes
import numpy as np

from kq_core.validate import is_int

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
PER_EXPERT_TEMPLATE = "model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
STACKED_TEMPLATE = "model.layers.{layer}.mlp.experts.{projection}"
# In a tensor name given to ExpertStore.for_tensors: a tensor per expert, the field its id fills.
EXPERT_FIELD = "{expert}"


class ExpertStoreError(ValueError):
    """A tensor is missing, mis-shaped or unreadable; the message names file, tensor and expert."""


class ExpertReadError(ExpertStoreError):
    """Reading an expert's bytes failed: the disk's error (an ``OSError`` from ``pread``), a short read, or a file
    gone or changed since its header was read. Not the checkpoint's layout nor an argument: the disk's state.
    The message names the file, and where one was being read the tensor, layer and expert."""


class ExpertStoreClosed(RuntimeError):
    """A read or a submission reached an :class:`ExpertStore` after :meth:`ExpertStore.close`."""


# The safetensors format caps the header at 100 MB.
MAX_HEADER_BYTES = 100_000_000
# What NumPy can hold: at most 32 dimensions (NumPy 1's limit), each an int64
MAX_DIMENSIONS, MAX_EXTENT = 32, 2**62


class FileIdentity(NamedTuple):
    """What tells a file apart from one saved again at its path: a replacement has another inode (or
    device), a rewrite in place another size or modification time. Not the change time: a chmod, a
    hardlink or a backup tool's atime reset moves it, and an open store would refuse every read after.
    What this misses: a same-size rewrite in place whose modification time was set back."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def file_identity(stat: os.stat_result) -> FileIdentity:
    """The :class:`FileIdentity` of an ``os.stat`` / ``os.fstat`` result."""
    return FileIdentity(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, a regular file; ExpertStoreError naming it otherwise (a FIFO is
    opened without waiting for a writer, then refused)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:  # a directory, a dangling link, a link loop, no permission, gone
        raise ExpertStoreError(f"{path}: cannot be opened as a safetensors file ({error.strerror or error})") from None
    if not stat_kinds.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ExpertStoreError(f"{path}: cannot be opened as a safetensors file (not a regular file)")
    return descriptor


def shared_memory_pairs(arrays: Sequence[Any]) -> list[tuple[int, int]]:
    """The pairs of ``arrays`` whose memory overlaps (one holds the other's bytes, or some of them).

    Args:
        arrays: any objects; only the non-empty NumPy arrays among them are compared.

    Returns:
        ``[(i, j), ...]`` indices into ``arrays``, ``i < j``, sorted; empty when no two share memory.
    """
    spans = []  # (first byte, last byte + 1, index); only arrays whose spans overlap are compared
    for index, value in enumerate(arrays):
        if isinstance(value, np.ndarray) and value.size:
            first = last = value.__array_interface__["data"][0]
            for extent, stride in zip(value.shape, value.strides):
                if stride < 0:
                    first += (extent - 1) * stride
                else:
                    last += (extent - 1) * stride
            spans.append((first, last + value.itemsize, index))
    spans.sort()
    pairs, reaching = set(), []  # reaching: the spans that end past the current one's start
    for span in spans:
        reaching = [other for other in reaching if other[1] > span[0]]
        for other in reaching:
            if np.shares_memory(arrays[span[2]], arrays[other[2]]):
                pairs.add((min(span[2], other[2]), max(span[2], other[2])))
        reaching.append(span)
    return sorted(pairs)


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int
    identity: FileIdentity  # of the file when its header was read


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Parses and checks one file's header as the safetensors format defines it: ``{name: TensorEntry}``.

    Checked: the header length fits the file (and the format's 100 MB cap); the header is a JSON
    object with unique keys; every tensor has a known dtype, a shape of non-negative ints and
    ``data_offsets [begin, end]`` with ``0 <= begin <= end <=`` the data's size and ``end - begin`` the
    bytes its dtype and shape take; no two tensors' bytes overlap.

    Raises:
        ExpertStoreError: naming the file, and the tensor where there is one.
    """
    path = Path(path)
    with open(open_regular(path), "rb") as handle:
        identity = file_identity(os.fstat(handle.fileno()))
        size = identity.size
        raw = handle.read(8)
        if len(raw) != 8:
            raise ExpertStoreError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ExpertStoreError(f"{path}: header length {length} does not fit the file's {size} bytes "
                                   f"(or the format's {MAX_HEADER_BYTES}-byte cap)")
        try:
            # The format's header is UTF-8 JSON (json.loads would also take UTF-16 and UTF-32 bytes).
            header = json.loads(handle.read(length).decode("utf-8"), object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as error:  # RecursionError: arrays nested past Python's stack
            raise ExpertStoreError(f"{path}: unreadable safetensors header ({type(error).__name__}: "
                                   f"{str(error)[:200]})") from None
    if not isinstance(header, dict):
        raise ExpertStoreError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
    data_size = size - 8 - length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, 8 + length, data_size, identity)
    spans = sorted((e.offset, e.offset + e.nbytes, name) for name, e in entries.items() if e.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ExpertStoreError(f"{path}: tensors {first} and {second} overlap in the file's data")
    return entries


def read_safetensors_headers(paths: Sequence[str | os.PathLike]) -> dict[str, TensorEntry]:
    """The headers of a checkpoint's files (its shards), as one ``{name: TensorEntry}``.

    Raises:
        ExpertStoreError: a header :func:`read_safetensors_header` refuses, or a tensor in two of the files
            (naming both).
    """
    entries: dict[str, TensorEntry] = {}
    for path in paths:
        for name, entry in read_safetensors_header(path).items():
            if name in entries:
                raise ExpertStoreError(f"tensor {name} is in {entries[name].path} and in {entry.path}; a checkpoint "
                                       f"holds each tensor once")
            entries[name] = entry
    return entries


def _entry(path: Path, name: str, info, data_start: int, data_size: int, identity) -> TensorEntry:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise ExpertStoreError(f"{where}: needs dtype, shape and data_offsets, got {info!r}")
    if info["dtype"] not in SAFETENSORS_DTYPES:
        raise ExpertStoreError(f"{where} has dtype {info['dtype']!r}, which kq cannot read")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMENSIONS
            and all(is_int(d) and 0 <= d <= MAX_EXTENT for d in shape)):
        raise ExpertStoreError(f"{where}: shape must be a list of at most {MAX_DIMENSIONS} ints in [0, {MAX_EXTENT}], "
                               f"got {shape!r}"[:400])
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ExpertStoreError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    if end > data_size:
        raise ExpertStoreError(f"{where}: data_offsets {offsets} run past the end of the file's {data_size} data bytes")
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    want = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap around
    if end - begin != want:
        raise ExpertStoreError(f"{where}: {info['dtype']}{shape} takes {want} bytes, its data_offsets span "
                               f"{end - begin}")
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, end - begin, identity)


def _release(descriptors: dict, pool: ThreadPoolExecutor) -> None:
    """What a store dropped without ``close()`` holds, let go: its reader threads and its files."""
    pool.shutdown(wait=False)
    _close_files(descriptors)


def _close_files(descriptors: dict) -> None:
    for descriptor in descriptors.values():
        os.close(descriptor)
    descriptors.clear()


def _checked_ids(method: str, layer, expert) -> tuple[int, int]:
    """``(layer, expert)`` as Python ints; ValueError naming the one that is no int >= 0 (NumPy ints count,
    bools do not)."""
    for name, value in (("layer", layer), ("expert", expert)):
        if not is_int(value) or value < 0:
            raise ValueError(f"ExpertStore.{method}: {name} must be an int >= 0, got {value!r}")
    return int(layer), int(expert)


class ExpertStore:
    """Reads one expert of one layer (all its projections) from safetensors files.

    Args:
        paths: a ``.safetensors`` file, a directory of them, or a list of files.
        layout: ``"per_expert"`` or ``"stacked"``.
        projections: projection names, e.g. ``("gate_proj", "up_proj", "down_proj")``.
        template: tensor-name template with ``{layer}``, ``{projection}`` and,
            for per-expert files, ``{expert}``. Defaults to the usual HF names.
        queue_depth: concurrent reads (worker threads) for :meth:`submit`.
        host_allocator: ``(shape, dtype) -> array`` the reads land in, one call per projection read
            (default: fresh memory per read). Give one that returns page-locked memory, e.g. CuPy's
            ``cupyx.empty_pinned`` (its pool recycles the buffers once the arrays are freed), and a
            GPU arena copies landed experts at the pinned rate rather than the pageable one. Each
            projection of a read needs memory of its own: buffers that overlap are refused.

    Raises:
        ExpertStoreError: no safetensors file found, a header that cannot be read, or a tensor in two of
            the files (naming both).

    :meth:`for_tensors` and :meth:`for_arenas` build a store from each layer's own tensor names instead of
    a template (checkpoints whose first layers are dense, biases beside weights).
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                 layout: Literal["per_expert", "stacked"] = "per_expert",
                 projections: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
                 template: str | None = None, queue_depth: int = 8, host_allocator=None):
        if layout not in ("per_expert", "stacked"):
            raise ValueError(f"ExpertStore: layout must be 'per_expert' or 'stacked', got {layout!r}")
        if not is_int(queue_depth) or queue_depth < 1:
            raise ValueError(f"ExpertStore: queue_depth must be an int >= 1 (reader threads), got {queue_depth!r}")
        if isinstance(projections, str) or not projections or not all(isinstance(p, str) for p in projections):
            raise ValueError(f"ExpertStore: projections must name at least one projection (strings), got "
                             f"{projections!r}")
        if host_allocator is not None and not callable(host_allocator):
            raise ValueError(f"ExpertStore: host_allocator must be a callable (shape, dtype) -> array, got "
                             f"{host_allocator!r}")
        self.host_allocator = host_allocator
        self.layout = layout
        self.projections = tuple(projections)
        self.template = template or (PER_EXPERT_TEMPLATE if layout == "per_expert" else STACKED_TEMPLATE)
        fields = ("{layer}", "{expert}", "{projection}") if layout == "per_expert" else ("{layer}", "{projection}")
        missing = [f for f in fields if f not in self.template]
        if missing:
            raise ValueError(f"ExpertStore: a {layout} template must name {', '.join(fields)}; "
                             f"{self.template!r} lacks {', '.join(missing)}")
        try:
            self.template.format(layer=0, expert=0, projection=self.projections[0])
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"ExpertStore: the template {self.template!r} names a field other than "
                             f"{', '.join(fields)} or is malformed ({type(error).__name__}: {error})") from None
        files = self._files(paths)
        self._names: dict[int, dict[str, str]] | None = None  # for_tensors: layer -> {payload key: tensor}
        self.tensors: dict[str, TensorEntry] = read_safetensors_headers(files)
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="kq-expert-read")
        self._descriptors: dict[Path, int] = {}
        # A store dropped without close() closes its files (no read holds it then: a read keeps it alive).
        weakref.finalize(self, _release, self._descriptors, self._pool)
        self._lock = threading.Lock()
        self._closing = self._closed = False  # closing: no submission taken; closed: no read either
        self._reads_running = 0  # reads holding descriptors: close closes the files once none is left
        self.bytes_read = 0

    @classmethod
    def for_tensors(cls, paths: str | os.PathLike | Sequence[str | os.PathLike],
                    names: Mapping[int, Mapping[str, str]], *, queue_depth: int = 8,
                    host_allocator=None) -> "ExpertStore":
        """A store reading each layer's experts from tensors named per layer: stacked ``[E, ...]``, or one
        tensor per expert where the name holds ``{expert}``.

        One expert is the slice ``[expert]`` of each of its layer's stacked tensors (or its own tensor): read
        with one ``pread`` of its bytes, never the whole tensor nor another expert.

        Args:
            paths: a ``.safetensors`` file, a directory of them, or a list of files.
            names: ``{layer: {payload key: tensor name}}``, e.g. ``{0: {"gate_proj":
                "model.layers.3.mlp.experts.gate_proj.weight", "gate_proj.bias": ...}}`` or
                ``{0: {"gate_proj": "model.layers.3.mlp.experts.{expert}.gate_proj.weight"}}``; the layer
                numbers are the residency manager's, the tensor names the checkpoint's. Each read returns
                ``{payload key: array}``.
            queue_depth, host_allocator: as the constructor's.

        The store's ``layout`` is ``"named"`` and its ``template`` the names as JSON (what a cache of its
        reads keys on).

        Raises:
            ExpertStoreError: a named tensor is in none of the files, is not stacked (no leading expert
                axis), or the tensors of one layer hold different numbers of experts (the message names
                the tensor and the files).
            ValueError: ``names`` is not a mapping of int layers to non-empty ``{str: str}`` mappings.
        """
        if not isinstance(names, Mapping) or not names:
            raise ValueError(f"ExpertStore.for_tensors: names must be a non-empty mapping layer -> "
                             f"{{payload key: tensor name}}, got {names!r}")
        checked = {}
        for layer, keys in names.items():
            if not is_int(layer) or layer < 0:
                raise ValueError(f"ExpertStore.for_tensors: names' layers must be ints >= 0, got {layer!r}")
            if (not isinstance(keys, Mapping) or not keys
                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())):
                raise ValueError(f"ExpertStore.for_tensors: layer {layer}'s names must be a non-empty mapping of "
                                 f"payload key to tensor name (str: str), got {keys!r}")
            checked[int(layer)] = dict(keys)
        store = cls(paths, layout="stacked", projections=tuple(next(iter(checked.values()))),
                    queue_depth=queue_depth, host_allocator=host_allocator)
        store._names = checked
        # What names this store's tensors (a cache of what it reads, such as kq_host.tier's, keys on it):
        # the names themselves, in place of a template.
        store.template = json.dumps({str(layer): keys for layer, keys in sorted(checked.items())}, sort_keys=True)
        store.layout = "named"
        try:
            for layer, keys in checked.items():
                counts = {}
                for name in keys.values():
                    first = name.replace(EXPERT_FIELD, "0")
                    entry = store.tensors.get(first)
                    if entry is None:
                        raise ExpertStoreError(f"layer {layer}: tensor {first} is in none of the store's files "
                                               f"({store._files_shown()})")
                    if EXPERT_FIELD in name:  # a tensor per expert: the experts are those named 0, 1, ...
                        counts[name] = next(e for e in itertools.count(1)
                                            if name.replace(EXPERT_FIELD, str(e)) not in store.tensors)
                    elif not entry.shape:
                        raise ExpertStoreError(f"{entry.path}: tensor {name} is a scalar, not a stack of experts")
                    else:
                        counts[name] = entry.shape[0]
                if len(set(counts.values())) > 1:
                    raise ExpertStoreError(f"layer {layer}: its tensors hold different numbers of experts "
                                           f"({', '.join(f'{n}: {c}' for n, c in counts.items())})")
        except ExpertStoreError:
            store.close()
            raise
        return store

    @classmethod
    def for_arenas(cls, paths: str | os.PathLike | Sequence[str | os.PathLike], arenas: Sequence, *,
                   queue_depth: int = 8, host_allocator=None) -> "ExpertStore":
        """A store for a model's arenas, layer ``i`` read from ``arenas[i].tensor_names()`` (the mlx-lm
        adapter's :meth:`~kq_mlx.mlx_lm_adapter.ArenaLayer.tensor_names`: ``{payload key: tensor name}``).

        Raises:
            ExpertStoreError, ValueError: as :meth:`for_tensors`.
        """
        return cls.for_tensors(paths, {layer: arena.tensor_names() for layer, arena in enumerate(arenas)},
                               queue_depth=queue_depth, host_allocator=host_allocator)

    @property
    def layer_tensor_names(self) -> dict[int, dict[str, str]] | None:
        """``{layer: {payload key: tensor name}}`` of a store from :meth:`for_tensors` (a copy; ``{expert}`` where
        a name is one tensor per expert), None for a template's store."""
        return None if self._names is None else {layer: dict(keys) for layer, keys in self._names.items()}

    def _keys(self, layer: int) -> tuple[str, ...]:
        """The payload keys of ``layer``'s reads."""
        if self._names is None:
            return self.projections
        return tuple(self._layer_names(layer))

    def _layer_names(self, layer: int) -> dict[str, str]:
        names = self._names.get(layer) if isinstance(layer, (int, np.integer)) else None
        if names is None:
            raise ExpertStoreError(f"layer {layer!r}: the store names tensors for layers "
                                   f"{sorted(self._names)} only")
        return names

    def _tensor_name(self, layer: int, expert: int, projection: str) -> str:
        if self._names is None:
            return self.template.format(layer=layer, expert=expert, projection=projection)
        return self._layer_names(layer)[projection].replace(EXPERT_FIELD, str(expert))

    def _files_shown(self) -> str:
        files = sorted({e.path.name for e in self.tensors.values()})
        return ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")

    @staticmethod
    def _files(paths) -> list[Path]:
        if isinstance(paths, (str, os.PathLike)):
            root = Path(paths)
            files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        else:
            files = [Path(p) for p in paths]
        if not files:
            raise ExpertStoreError(f"ExpertStore: no .safetensors files in {paths}")
        return files

    def _descriptor(self, entry: TensorEntry) -> int:
        """An open descriptor of the entry's file, checked to be the file whose header was read (for a read
        counted in ``_reads_running``: a read running when :meth:`close` ran goes on, its files closed after it)."""
        with self._lock:
            if entry.path not in self._descriptors:
                try:
                    self._descriptors[entry.path] = open_regular(entry.path)
                except ExpertStoreError as error:
                    raise ExpertReadError(f"{error} since its header was read; open a new ExpertStore") from None
            descriptor = self._descriptors[entry.path]
        try:
            # The open file, and the file now at its path (a checkpoint saved again replaces the file).
            changed = (file_identity(os.fstat(descriptor)) != entry.identity
                       or file_identity(os.stat(entry.path)) != entry.identity)
        except OSError:
            changed = True
        if changed:
            raise ExpertReadError(f"{entry.path} changed after its header was read (device, inode, size or "
                                   f"modification time differ, or the file is gone); open a new ExpertStore on the new file")
        return descriptor

    def _locate(self, layer: int, expert: int, projection: str) -> tuple[TensorEntry, int, int, tuple[int, ...]]:
        """(entry, byte offset, byte count, shape) of one projection of one expert."""
        name = self._tensor_name(layer, expert, projection)
        entry = self.tensors.get(name)
        if entry is None:
            raise ExpertStoreError(f"expert {expert} of layer {layer}: tensor {name} is in none of the store's "
                                   f"files ({self._files_shown()})")
        one_tensor_an_expert = (self.layout == "per_expert" if self._names is None
                                else EXPERT_FIELD in self._layer_names(layer)[projection])
        if one_tensor_an_expert:
            return entry, entry.offset, entry.nbytes, entry.shape
        if len(entry.shape) < 1 or not 0 <= expert < entry.shape[0]:
            raise ExpertStoreError(f"{entry.path}: tensor {name} has shape {list(entry.shape)}, "
                                   f"which holds no expert {expert}")
        stride = entry.nbytes // entry.shape[0]
        return entry, entry.offset + expert * stride, stride, entry.shape[1:]

    def expert_shapes(self, layer: int, expert: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{projection: (shape, dtype)}`` of one expert, from the headers alone."""
        out = {}
        for projection in self._keys(layer):
            entry, _, _, shape = self._locate(layer, expert, projection)
            out[projection] = (shape, entry.dtype)
        return out

    def _layer_shapes(self, layer: int) -> dict:
        """Expert 0's shapes, the default every expert of the layer must match ({} if it is absent)."""
        try:
            return self.expert_shapes(layer, 0)
        except ExpertStoreError:
            return {}

    def expert_nbytes(self, layer: int, expert: int = 0) -> int:
        return sum(self._locate(layer, expert, p)[2] for p in self._keys(layer))

    def read_expert(self, layer: int, expert: int, *,
                    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None) -> dict[str, np.ndarray]:
        """Reads all projections of one expert (blocking).

        Args:
            layer, expert: which expert.
            expected: ``{projection: (shape, dtype)}`` each read must match (the
                arena's slot layout). Default: the layer's expert 0, so one
                mis-shaped expert in a per-expert checkpoint is caught.

        Returns:
            ``{projection: array}`` in the file's dtype and shape.

        Raises:
            ExpertStoreError: a missing tensor, a shape/dtype that differs from ``expected`` (the
                message names file, tensor and expert), or ``host_allocator`` buffers of two projections
                that overlap.
            ExpertReadError: (an ExpertStoreError) the read failed: an ``OSError`` from the disk, a short
                read, or a file gone or changed since its header was read (naming file, tensor, layer and
                expert).
            ExpertStoreClosed: the store was closed.
            ValueError: ``layer`` or ``expert`` is no int >= 0.
        """
        layer, expert = _checked_ids("read_expert", layer, expert)
        with self._lock:
            if self._closed:
                raise ExpertStoreClosed(self._closed_message("read_expert"))
            self._reads_running += 1
        try:
            return self._read_projections(layer, expert, expected)
        finally:
            with self._lock:
                self._reads_running -= 1
                if self._closed and not self._reads_running:
                    _close_files(self._descriptors)  # with _lock held

    def _read_projections(self, layer: int, expert: int, expected) -> dict[str, np.ndarray]:
        """:meth:`read_expert`'s reads, one ``pread`` per projection."""
        located = {}  # projection: (entry, offset, nbytes, shape, tensor name)
        for projection in self._keys(layer):
            entry, offset, nbytes, shape = self._locate(layer, expert, projection)
            name = self._tensor_name(layer, expert, projection)
            if expected is None:
                expected = self._layer_shapes(layer)
            if projection in expected:
                want_shape, want_dtype = expected[projection]
                if tuple(want_shape) != tuple(shape) or np.dtype(want_dtype) != entry.dtype:
                    raise ExpertStoreError(
                        f"{entry.path}: tensor {name} (expert {expert} of layer {layer}) is "
                        f"{entry.dtype.name}{list(shape)}, the arena expects {np.dtype(want_dtype).name}{list(want_shape)}")
            located[projection] = entry, offset, nbytes, shape, name
        buffers = None if self.host_allocator is None else self._allocated_read(located, layer, expert)
        out = {}
        nbytes_total = 0
        for projection, (entry, offset, nbytes, shape, name) in located.items():
            descriptor = self._descriptor(entry)
            try:
                if buffers is None:
                    data = os.pread(descriptor, nbytes, offset)
                    count = len(data)
                else:
                    count = os.preadv(descriptor, [buffers[projection].reshape(-1).view(np.uint8)], offset)
            except OSError as error:  # the disk's error (EIO), or a file system gone (ESTALE, ENOTCONN)
                raise ExpertReadError(f"{entry.path}: tensor {name} (expert {expert} of layer {layer}): the read "
                                      f"of {nbytes} bytes at offset {offset} failed "
                                      f"({error.strerror or type(error).__name__})") from None
            if count != nbytes:
                raise ExpertReadError(f"{entry.path}: tensor {name} (expert {expert} of layer {layer}): "
                                      f"read {count} of {nbytes} bytes; the file is truncated")
            array = np.frombuffer(data, dtype=entry.dtype).reshape(shape) if buffers is None else buffers[projection]
            out[projection] = array
            nbytes_total += nbytes
        with self._lock:
            self.bytes_read += nbytes_total
        return out

    def _allocated_read(self, located: Mapping[str, tuple], layer: int, expert: int) -> dict[str, np.ndarray]:
        """``{projection: buffer}`` from ``host_allocator`` for one read, checked to share no memory."""
        buffers = {projection: self._allocated(shape, entry.dtype)
                   for projection, (entry, _, _, shape, _) in located.items()}
        names = list(buffers)
        pairs = shared_memory_pairs(list(buffers.values()))
        if pairs:
            earlier, later = (names[index] for index in pairs[0])
            raise ExpertStoreError(
                f"ExpertStore: host_allocator returned {later}'s buffer overlapping {earlier}'s "
                f"(expert {expert} of layer {layer}); each projection of a read needs memory of its own "
                f"(an allocator keeping one buffer per shape hands the same one out twice)")
        return buffers

    def _allocated(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer from ``host_allocator``, checked to be a writable C-contiguous array of the read."""
        array = self.host_allocator(shape, dtype)
        if (not isinstance(array, np.ndarray) or array.shape != tuple(shape) or array.dtype != dtype
                or not array.flags.c_contiguous or not array.flags.writeable):
            got = (f"{array.dtype.name}{list(array.shape)}, c_contiguous={array.flags.c_contiguous}, "
                   f"writeable={array.flags.writeable}") if isinstance(array, np.ndarray) else type(array).__name__
            raise ExpertStoreError(f"ExpertStore: host_allocator({tuple(shape)}, {dtype.name}) must return a "
                                   f"writable C-contiguous NumPy array of that shape and dtype, got {got}")
        return array

    def submit(self, layer: int, expert: int, **kwargs) -> Future:
        """Queues :meth:`read_expert` on the reader pool; the future holds the arrays or the error.

        Raises:
            ExpertStoreClosed: the store was closed.
            ValueError: ``layer`` or ``expert`` is no int >= 0.
        """
        return self.submit_read(self.read_expert, layer, expert, **kwargs)

    def submit_read(self, read: Callable[..., Any], layer: int, expert: int, **kwargs) -> Future:
        """Queues ``read(layer, expert, **kwargs)`` on the reader pool, as :meth:`submit` queues its own read:
        for a reader over this store (its reads waited for by :meth:`close`, refused after it)."""
        layer, expert = _checked_ids("submit", layer, expert)
        with self._lock:
            if self._closing:
                raise ExpertStoreClosed(self._closed_message("submit"))
            return self._pool.submit(read, layer, expert, **kwargs)

    def close(self) -> None:
        """Waits for the submitted reads and closes the files; later reads and submissions raise
        :class:`ExpertStoreClosed`. A read still running on another thread keeps its file open until it ends."""
        with self._lock:
            self._closing = True
        self._pool.shutdown(wait=True)
        with self._lock:
            self._closed = True
            if not self._reads_running:
                _close_files(self._descriptors)  # with _lock held


    @staticmethod
    def _closed_message(method: str) -> str:
        return f"ExpertStore.{method}: the store was closed (its files are closed); open a new ExpertStore to read"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
