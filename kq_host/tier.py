"""The low-precision tier: every expert of every layer, quantized, beside the full-precision arena.

With ``route_shed(..., on_miss="tier")`` a routed expert that is not in the arena is computed with
its copy here instead of being dropped. The format is affine group quantization as mlx-community's
checkpoints store it (what ``mx.quantize`` returns for a 16-bit weight and ``mx.gather_qmm`` reads):
along each weight row's input axis, ``group_size`` values share a ``scale`` and a ``bias``, both
bfloat16 (float16 for a float16 weight), and ``w ~= scale * q + bias`` with ``q`` in ``[0, 2**bits)``,
the q of a row packed as one little-endian bit stream into uint32 words: ``bits + 32 / group_size``
bits a weight (:func:`bits_per_weight`). :func:`quantize` rounds as ``mx.quantize`` does, bit for bit.
A JAX layer dequantizes the rows it gathers; an MLX layer hands the arrays to ``gather_qmm`` as they
are. Built once from an :class:`~kq_host.expert_store.ExpertStore` (:func:`build_tier`) and cached on
disk: one entry per checkpoint and options, valid while the checkpoint's bytes are those it was built
from; or read from a lower-bit mlx-lm conversion of the model (:func:`kq_host.checkpoint.tier_from_checkpoint`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import struct
import tempfile
import threading
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

import ml_dtypes
import numpy as np

from kq_core.validate import is_int
from kq_host.expert_store import ExpertStoreError, FileIdentity, file_identity, shared_memory_pairs

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)
# The tier's options where none are given: build_tier's, kq demo's, kq generate's and kq study's (4 bits in groups
# of 32: 5 bits a weight with the 16-bit scales and biases, under a third of a bfloat16 expert). 3 bits took the
# shipped model's greedy text off the resident model's at its first token through a quarter arena (kq demo).
DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE = 4, 32
# The packing word: q values run through uint32 words as one little-endian bit stream.
WORD_BITS = 32
# The dtypes of the tier's scales and biases, by name (as the cache stores them): mlx-community's 16 bits.
SCALE_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
SCALE_BITS = 16
# The dtypes quantize takes: the 16-bit ones as they are, wider ones rounded to bfloat16 first.
WEIGHT_DTYPES = (*SCALE_DTYPES.values(), np.dtype(np.float32), np.dtype(np.float64))
_CACHE_VERSION = "3"


class TierOptionError(ValueError):
    """An option of the tier (bits, group size, a weight's shape) is not one the format takes."""


class WeightValueError(TierOptionError):
    """A weight holds values the format cannot hold: not finite, or a group whose range is too wide for its
    values to come back finite. The weight's fault, not the options'."""


class QuantizedWeight(NamedTuple):
    """One weight (or a stack of them) in the tier's format.

    Attributes:
        packed: uint32 ``[..., out, in * bits / 32]``.
        scales: ``[..., out, in / group_size]``: bfloat16 or float16 in the tier (:func:`quantize`); a
            checkpoint of float32 scales is read (:func:`dequantize`) but not made a tier.
        biases: as ``scales``.
    """

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes


def check_options(bits: int, group_size: int) -> None:
    """Raises :class:`TierOptionError` naming ``bits`` or ``group_size`` if the format does not take it."""
    if not (is_int(bits) and bits in BITS):
        raise TierOptionError(f"tier: bits must be one of {BITS}, got {bits!r}")
    if not (is_int(group_size)
            and group_size in GROUP_SIZES):
        raise TierOptionError(f"tier: group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def quantize(weight: np.ndarray, *, bits: int, group_size: int) -> QuantizedWeight:
    """Affine group quantization of ``weight`` ``[..., in]`` along its last axis, bit for bit as
    ``mx.quantize`` (affine mode) gives it for the weight in its 16-bit dtype.

    A float32 or float64 weight is rounded to bfloat16 first (a float64 one through float32), as
    ``mlx_lm.convert`` rounds a model to its dtype before quantizing; a bfloat16 or float16 weight is
    quantized as it is. Then, per group, in float32: with ``lo``, ``hi`` the group's extremes and
    ``levels = 2**bits - 1``, the edge is the extreme of larger magnitude (``hi`` on a tie) and
    ``scale = max((hi - lo) / levels, 1e-7)``, negated when the edge is ``hi``; ``q0 = rint(edge / scale)``;
    unless ``q0`` is 0, ``scale = edge / q0`` and ``bias = edge`` (so the edge and zero lie on the grid),
    else ``bias = 0``; then ``q = clip(rint((w - bias) / scale), 0, levels)`` with the float32 scale and
    bias, which are stored rounded to the 16-bit dtype. ``scale * q`` is exact in float32 (at most
    11 + 8 significant bits), so a backend that fuses dequantization's multiply and add into an FMA
    rounds as one that does not.

    Args:
        weight: bfloat16, float16, float32 or float64 ``[..., in]``, ``in`` a multiple of ``group_size``,
            every value finite in bfloat16 (float16 for a float16 weight).
        bits: 2, 3, 4 or 8.
        group_size: 32, 64 or 128.

    Returns:
        :class:`QuantizedWeight`: packed uint32 ``[..., in * bits / 32]``, scales and biases
        ``[..., in / group_size]`` in the 16-bit dtype (bfloat16, or float16 for a float16 weight).

    Raises:
        TierOptionError: an option, dtype or shape the format does not take; its WeightValueError: a value
            that is not finite in the 16-bit dtype, or a group whose range is too wide for its values to
            dequantize finite.
    """
    check_options(bits, group_size)
    weight = np.asarray(weight)
    if weight.dtype not in WEIGHT_DTYPES:
        raise TierOptionError(f"tier: a weight to quantize must be bfloat16, float16, float32 or float64, "
                              f"got {weight.dtype}")
    if weight.ndim < 1 or weight.shape[-1] % group_size:
        raise TierOptionError(f"tier: a weight's last axis must be a multiple of group_size={group_size}, "
                              f"got shape {weight.shape}")
    dtype = scale_dtype(weight.dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # values beyond the 16-bit range become inf: refused below
        weight = weight.astype(np.float32).astype(dtype)
    if not np.all(np.isfinite(weight)):
        raise WeightValueError(f"tier: a weight to quantize holds inf or NaN, or values beyond {dtype.name}'s range "
                              f"(the tier stores {dtype.name} scales and biases)")
    groups = weight.astype(np.float32).reshape(*weight.shape[:-1], weight.shape[-1] // group_size, group_size)
    levels = np.float32((1 << bits) - 1)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    edge_is_low = np.abs(low) > np.abs(high)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # non-finite results: refused below
        scale = np.maximum((high - low) / levels, _MLX_EPS)
        scale = np.where(edge_is_low, scale, -scale)
        edge = np.where(edge_is_low, low, high)
        q0 = np.rint(edge / scale)
        on_grid = q0 != 0
        scale = np.where(on_grid, edge / np.where(on_grid, q0, np.float32(1)), scale)
        bias = np.where(on_grid, edge, np.float32(0))
        q = np.clip(np.rint((groups - bias[..., None]) / scale[..., None]), 0, levels)
        scales, biases = scale.astype(dtype), bias.astype(dtype)
        top = scales.astype(np.float32) * levels + biases.astype(np.float32)  # the grid's far end
    # A constant group beyond 1e-7 * float32's largest value: edge / scale overflows, q0 is inf, the scale 0,
    # and (w - bias) / scale is 0 / 0; every q is 0 there, the value the bias alone.
    q = np.where(np.isnan(q), np.float32(0), q)
    if not (np.all(np.isfinite(scales)) and np.all(np.isfinite(top))):
        raise WeightValueError(f"tier: a weight has a group whose range (max - min) is too wide for {dtype.name} at "
                              f"bits={bits}: its values cannot come back finite from the format")
    return QuantizedWeight(pack(q.astype(np.uint32).reshape(weight.shape), bits), scales, biases)


# mx.quantize's smallest scale magnitude (a group's range below levels * 1e-7 gets this scale).
_MLX_EPS = np.float32(1e-7)


def scale_dtype(weight_dtype) -> np.dtype:
    """The 16-bit dtype :func:`quantize` gives the scales and biases of a weight of ``weight_dtype``:
    float16 for float16, else bfloat16 (the dtype mlx-community's checkpoints store)."""
    return np.dtype(np.float16) if np.dtype(weight_dtype) == np.float16 else np.dtype(ml_dtypes.bfloat16)


def bits_per_weight(bits: int, group_size: int) -> float:
    """What one weight costs in the tier: its ``bits`` plus its share of a 16-bit scale and bias.

    Returns:
        ``bits + 32 / group_size`` (2-bit in groups of 64: 2.5).

    Raises:
        TierOptionError: naming ``bits`` or ``group_size`` if the format does not take it.
    """
    check_options(bits, group_size)
    return bits + 2 * SCALE_BITS / group_size


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint32 ``[..., n * bits / 32]``: ``q`` ``[..., n]`` (each < 2**bits) as a little-endian bit stream."""
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)  # [..., n, bits]
    packed = np.packbits(stream.reshape(*q.shape[:-1], q.shape[-1] * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def _check_read_bits(bits) -> None:
    """TierOptionError naming ``bits`` unless a stored weight can have them (MLX packs 1 to 8 bits)."""
    if not (is_int(bits) and 1 <= bits <= 8):
        raise TierOptionError(f"tier: bits must be an int in [1, 8], got {bits!r}")


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack`: uint32 ``[..., n]`` values.

    Raises:
        TierOptionError: ``bits`` is no int in [1, 8].
    """
    _check_read_bits(bits)
    packed = np.asarray(packed, dtype=np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:  # whole values per word: shift each word
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        return ((packed[..., None] >> shifts) & mask).reshape(*packed.shape[:-1], packed.shape[-1] * shifts.size)
    # a value may straddle two words: read each value from the 64 bits of its word and the next
    start = np.arange(packed.shape[-1] * 32 // bits, dtype=np.int64) * bits
    word, offset = start // 32, (start % 32).astype(np.uint64)
    wide = np.concatenate([packed, np.zeros((*packed.shape[:-1], 1), np.uint32)], axis=-1).astype(np.uint64)
    pairs = wide[..., word] | (wide[..., word + 1] << np.uint64(32))
    return ((pairs >> offset) & np.uint64(mask)).astype(np.uint32)


def dequantize(weight: QuantizedWeight, *, bits: int, group_size: int) -> np.ndarray:
    """float32 ``[..., in]``: ``scale * q + bias`` per group, in float32 (the reference of the layers).

    Raises:
        TierOptionError: ``bits`` or ``group_size`` is no option a weight can have, or disagrees with the
            shapes of ``weight``'s arrays (naming them), or the packed values are no uint32 words.
    """
    _check_read_bits(bits)
    if not (is_int(group_size)
            and group_size >= 1):
        raise TierOptionError(f"tier: group_size must be an int >= 1, got {group_size!r}")
    packed, scales, biases = (np.asarray(a) for a in weight)
    if packed.dtype != np.uint32:
        raise TierOptionError(f"tier: a weight's packed values are uint32 words; got {packed.dtype.name}")
    width = packed.shape[-1] * WORD_BITS // bits if packed.ndim else 0
    if (packed.ndim < 1 or width % group_size or scales.shape != biases.shape
            or scales.shape != (*packed.shape[:-1], width // group_size)):
        raise TierOptionError(f"tier: a weight of {bits} bits in groups of {group_size} packs [..., in * {bits} / "
                              f"32] words beside [..., in / {group_size}] scales and biases; got packed "
                              f"{list(packed.shape)}, scales {list(scales.shape)}, biases {list(biases.shape)}")
    q = unpack(packed, bits).astype(np.float32)
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    values = groups * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return values.reshape(q.shape)


@dataclass(frozen=True)
class Tier:
    """Every expert of every layer quantized: ``{projection: QuantizedWeight [L, E, out, ...]}``.

    Attributes:
        weights: per projection, the stacked quantized weights.
        bits, group_size: the format's options.
    """

    weights: Mapping[str, QuantizedWeight]
    bits: int
    group_size: int

    def __post_init__(self):
        if not isinstance(self.weights, Mapping) or not self.weights:
            raise TierOptionError(f"tier: weights must map each projection to its QuantizedWeight, got "
                                  f"{self.weights!r}"[:300])

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    @property
    def num_layers(self) -> int:
        return next(iter(self.weights.values())).packed.shape[0]

    @property
    def num_experts(self) -> int:
        return next(iter(self.weights.values())).packed.shape[1]

    def layer(self, layer: int) -> dict[str, QuantizedWeight]:
        """One layer's ``{projection: QuantizedWeight [E, out, ...]}``."""
        return {name: QuantizedWeight(*(a[layer] for a in w)) for name, w in self.weights.items()}


def build_tier(store, num_layers: int, num_experts: int, *, bits: int = DEFAULT_TIER_BITS,
               group_size: int = DEFAULT_TIER_GROUP_SIZE, cache_dir: str | os.PathLike | None = None) -> Tier:
    """Quantizes every expert the store holds, or loads the cached result of the same build.

    The cache keeps one entry per checkpoint (its files' paths, the store's layout and the tensors each
    layer is read from) and options, valid
    while the checkpoint's files are those it was built from: each file's device, inode, size,
    modification and change times and a digest of its safetensors header (a hit reads the headers,
    not the weights; what that misses: ``_content_digest``); a changed checkpoint's entry is rebuilt
    in place. An entry that is unreadable, does not hold the
    request's layers, experts, projections, shapes and dtypes, or holds a scale or bias that is not finite
    is rebuilt with a warning; a cache that
    cannot be written leaves the tier uncached with a warning.

    Args:
        store: an :class:`~kq_host.expert_store.ExpertStore` (or a store with its ``read_expert``,
            ``expert_shapes``, ``projections`` and ``tensors``, and ``layer_tensor_names`` where it has one).
        num_layers, num_experts: L and E of the checkpoint, as the store holds them.
        bits, group_size: as for :func:`quantize` (default :data:`DEFAULT_TIER_BITS`,
            :data:`DEFAULT_TIER_GROUP_SIZE`).
        cache_dir: where built tiers are kept (``None``: ``$KQ_CACHE_DIR/tier`` or
            ``~/.cache/kq/tier``).

    Returns:
        :class:`Tier` with leading dims ``[num_layers, num_experts]``.

    Raises:
        TierOptionError: an option the format does not take, or ``num_layers`` / ``num_experts`` that
            disagree with the store.
        ExpertStoreError: a read failed, two projections of one read share memory (a store whose
            ``host_allocator`` hands one buffer to two reads), the checkpoint's files changed, or an expert
            holds values the format cannot hold (a NaN or an inf; naming its layer, expert and projection).
    """
    check_options(bits, group_size)
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
        if not (is_int(value) and value >= 1):
            raise TierOptionError(f"tier: {name} must be an int >= 1, got {value!r}")
    num_layers, num_experts, bits, group_size = int(num_layers), int(num_experts), int(bits), int(group_size)
    shapes = checked_expert_shapes(store, num_layers, num_experts)
    path = _cache_path(store, num_layers, num_experts, bits, group_size, cache_dir)
    content = _content_digest(store)
    meta = {"version": _CACHE_VERSION, "content": content, "num_layers": num_layers, "num_experts": num_experts,
            "bits": bits, "group_size": group_size, "projections": list(store.projections),
            "layer_tensors": _layer_tensor_names(store)}
    cached = _load(path, meta, shapes)
    if cached is not None:
        return cached
    tier = Tier(quantize_experts(store.read_expert, store.projections, num_layers, num_experts, bits=bits,
                                 group_size=group_size), bits, group_size)
    if _content_digest(store) != content:
        raise ExpertStoreError(f"build_tier: the checkpoint's files ({', '.join(sorted(_files(store)))}) changed "
                               f"while the tier was built from them; build it again")
    try:
        _save(path, tier.weights, meta)
    except OSError as error:
        warnings.warn(f"build_tier: could not cache the tier in {path.parent} ({error}); it is returned uncached",
                      stacklevel=2)
    return tier


def checked_expert_shapes(store, num_layers: int, num_experts: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{projection: (shape, dtype)}`` every expert shares, once the store is checked to hold exactly
    ``num_layers`` layers of ``num_experts`` experts (from the headers alone).

    Raises:
        TierOptionError: the store holds other layers or experts than ``num_layers`` and ``num_experts``.
        ExpertStoreError: its layers' experts differ in shape.
    """

    def holds(layer: int, expert: int) -> bool:
        try:
            store.expert_shapes(layer, expert)
        except ExpertStoreError:
            return False
        return True

    if holds(num_layers, 0):
        raise TierOptionError(f"tier: num_layers={num_layers} disagrees with the store, which holds layer "
                              f"{num_layers} too")
    shapes = None
    for layer in range(num_layers):
        if not holds(layer, 0):
            raise TierOptionError(f"tier: num_layers={num_layers} disagrees with the store, which holds no "
                                  f"experts of layer {layer}")
        if not holds(layer, num_experts - 1):
            raise TierOptionError(f"tier: num_experts={num_experts} disagrees with the store: layer {layer} "
                                  f"holds no expert {num_experts - 1}")
        if holds(layer, num_experts):
            raise TierOptionError(f"tier: num_experts={num_experts} disagrees with the store: layer {layer} "
                                  f"holds expert {num_experts} too")
        layer_shapes = store.expert_shapes(layer, 0)
        if shapes is None:
            shapes = layer_shapes
        elif layer_shapes != shapes:
            raise ExpertStoreError(f"tier: layer {layer}'s experts are {layer_shapes}, layer 0's {shapes}; "
                                   f"a tier stacks one shape per projection")
    return shapes


def quantize_experts(read_expert, projections, num_layers: int, num_experts: int, *, bits: int,
                     group_size: int) -> dict[str, QuantizedWeight]:
    """Every expert read and quantized, each read's projections quantized before the next read.

    Args:
        read_expert: ``read_expert(layer, expert) -> {projection: float array [out, in]}``, one
            array per projection, none sharing memory with another.
        projections: the projections' names, in the tier's order.
        num_layers, num_experts: how many of each to read.
        bits, group_size: as for :func:`quantize`.

    Returns:
        ``{projection: QuantizedWeight}``, each field with leading dims ``[num_layers, num_experts]``.

    Raises:
        ExpertStoreError: an expert's values the format cannot hold (:class:`WeightValueError`: a NaN or an
            inf, a range too wide), naming its layer, expert and projection.
        TierOptionError: an expert's shape or dtype the options do not take, naming the same.
    """
    per_projection: dict[str, list[list[QuantizedWeight]]] = {p: [] for p in projections}
    for layer in range(num_layers):
        rows = {p: [] for p in projections}
        for expert in range(num_experts):
            read = read_expert(layer, expert)
            _refuse_shared_memory(read, layer, expert)
            for name in projections:
                try:
                    rows[name].append(quantize(read[name], bits=bits, group_size=group_size))
                except WeightValueError as error:  # the checkpoint's values: named, not blamed on the options
                    raise ExpertStoreError(f"layer {layer} expert {expert} {name}: {error}") from None
                except TierOptionError as error:
                    raise TierOptionError(f"layer {layer} expert {expert} {name}: {error}") from None
        for name in projections:
            per_projection[name].append(rows[name])
    return {name: QuantizedWeight(*(np.stack([np.stack([getattr(w, field) for w in layer]) for layer in layers])
                                    for field in QuantizedWeight._fields))
            for name, layers in per_projection.items()}


def _refuse_shared_memory(read: Mapping[str, np.ndarray], layer: int, expert: int) -> None:
    """Raises ExpertStoreError if two projections of one read share memory: one holds the other's bytes."""
    pairs = shared_memory_pairs(list(read.values()))
    if pairs:
        names = list(read)
        first, second = (names[index] for index in pairs[0])
        raise ExpertStoreError(
            f"build_tier: expert {expert} of layer {layer}: the store's reads of {first} and {second} share "
            f"memory (its host_allocator hands one buffer to both), so one holds the other's weights; "
            f"build the tier through a store without that host_allocator")


def _files(store) -> dict[str, FileIdentity]:
    """``{path: identity}`` of the store's files when their headers were read."""
    return {str(entry.path): entry.identity for entry in store.tensors.values()}


# A safetensors file opens with its header's length, a little-endian uint64.
_HEADER_LENGTH_BYTES = 8


def _content_digest(store) -> str:
    """A digest that changes when the store's files may hold other bytes, read from their metadata and
    headers only (a hit costs a stat and a header read per file, not a pass over the weights).

    Per file: its device, inode, size, modification and change times (ns) and a SHA-256 of its
    safetensors header. A rewrite in place, a replacement or a changed header changes the digest, and
    so does a same-size rewrite with its modification time set back: writing the file and setting its
    times both move the change time (ctime), which no user can set back. What this misses: on a
    filesystem whose timestamps are coarse (FAT's 2 s, ext3's and HFS+'s 1 s, and Linux's cached clock,
    a few ms, where the kernel does not keep fine-grained ctimes), a same-size rewrite of a tensor's
    bytes that leaves the header as it was, sets the mtime back and lands in the same ctime tick as
    the file's previous change; and a filesystem that reports no real ctime (some network and FUSE mounts).

    Raises:
        ExpertStoreError: a file cannot be read, or is not the one whose header the store read.
    """
    digest = hashlib.sha256()
    for path, identity in sorted(_files(store).items()):
        try:
            handle = open(path, "rb")
        except OSError as error:
            raise ExpertStoreError(f"{path}: cannot be opened to key the tier cache "
                                   f"({error.strerror or error})") from None
        with handle:
            stat = os.fstat(handle.fileno())
            if file_identity(stat) != identity:
                raise ExpertStoreError(f"{path} changed after its header was read (device, inode, size or "
                                       f"modification time differ); open a new store on the new file")
            length = handle.read(_HEADER_LENGTH_BYTES)
            header = handle.read(int.from_bytes(length, "little")) if len(length) == _HEADER_LENGTH_BYTES else b""
        digest.update("".join(f"{field}\0" for field in (Path(path).name, *identity, stat.st_ctime_ns)).encode())
        digest.update(hashlib.sha256(length + header).digest())
    return digest.hexdigest()


def _layer_tensor_names(store) -> tuple[tuple[int, tuple[tuple[str, str], ...]], ...] | None:
    """The tensors each layer's reads come from, as a store built from tensor names
    (``ExpertStore.for_tensors`` / ``for_arenas``) holds them: ``((layer, ((payload key, tensor name), ...)),
    ...)``, a name with ``{expert}`` for a tensor per expert; None for a store whose template names them.

    Two such stores over one file may read other layers' tensors with the same projections and files.
    A store without ``layer_tensor_names`` (:class:`~kq_host.checkpoint.DequantizedExperts`) is named by its
    template.
    """
    names = getattr(store, "layer_tensor_names", None)
    if names is None:
        return None
    return tuple((int(layer), tuple(sorted(keys.items()))) for layer, keys in sorted(names.items()))


def _cache_path(store, num_layers, num_experts, bits, group_size, cache_dir) -> Path:
    """The entry of this checkpoint (its files' paths, the store's layout and the tensors each layer reads)
    and these options."""
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("KQ_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kq") / "tier"
    key = hashlib.sha256(repr((_CACHE_VERSION, num_layers, num_experts, bits, group_size, store.projections,
                               type(store).__name__, store.template, store.layout, _layer_tensor_names(store),
                               repr(getattr(store, "quantization", None)),
                               sorted(str(Path(path).resolve()) for path in _files(store)))).encode()).hexdigest()[:20]
    return root / f"tier_{bits}bit_g{group_size}_{key}.npz"


def _save(path: Path, weights: Mapping[str, QuantizedWeight], meta: Mapping) -> None:
    """Writes the tier atomically (a temporary file of this call renamed over the entry, which has an ordinary
    file's mode: 0666 less the umask), the 16-bit scales and biases as their raw bits; the temporary is removed
    on any failure, an exception or SIGINT, and on SIGTERM (:func:`_sigterm_raised`).

    Raises:
        OSError: the directory cannot be made or written; InterruptedError where SIGTERM came during the save
            and the program's own handler returned.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"meta": np.array(json.dumps(meta, sort_keys=True))}
    for name, weight in weights.items():
        arrays[f"{name}.packed"] = weight.packed
        for field in ("scales", "biases"):
            array = getattr(weight, field)
            arrays[f"{name}.{field}"] = array.view(np.uint16)
            arrays[f"{name}.{field}.dtype"] = np.array(array.dtype.name)
    with _sigterm_raised():
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(descriptor, "wb") as out:
                os.fchmod(out.fileno(), 0o666 & ~_umask())  # an ordinary file's mode (mkstemp's is 0600)
                np.savez(out, **arrays)
            os.replace(temporary, path)
        except BaseException:  # SIGINT's KeyboardInterrupt and SIGTERM's _Terminated too
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` where Linux gives it, else set and restored (the one way
    POSIX has to read it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Terminated(BaseException):
    """SIGTERM, received while :func:`_sigterm_raised` holds it."""


@contextlib.contextmanager
def _sigterm_raised():
    """The block with SIGTERM raised in it as :class:`_Terminated`, so its cleanup runs (``timeout`` and service
    managers end a process with SIGTERM, whose default ends it at once). Then the signal is given back to the
    disposition that was in place: the default ends the process as SIGTERM does; a program's own handler is
    called, and if it returns the block's work counts as interrupted (InterruptedError, an OSError).

    Only on the main thread (Python runs signal handlers there alone), and not where SIGTERM is ignored or was
    set outside Python; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN:
        yield
        return

    def terminated(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)  # the default ends the process here
        raise InterruptedError("interrupted by SIGTERM") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


# What reading a damaged entry can raise.
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile, struct.error)


def _load(path: Path, meta: Mapping, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> Tier | None:
    """The cached tier at ``path`` if it is this build's, else None (a damaged or mismatched entry warned of)."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as cached:  # closed if np.load raises
            if json.loads(str(cached["meta"][()])) != json.loads(json.dumps(meta)):
                return None  # another checkpoint content's entry: rebuilt in place
            tier = _from_arrays(cached, meta["projections"], meta["bits"], meta["group_size"])
    except _UNREADABLE as error:
        warnings.warn(f"build_tier: the cached tier {path} is unreadable ({type(error).__name__}: {error}); "
                      f"building it again", stacklevel=3)
        return None
    mismatch = _mismatch(tier, meta["num_layers"], meta["num_experts"], shapes)
    if mismatch:
        warnings.warn(f"build_tier: the cached tier {path} does not hold the request ({mismatch}); building it again",
                      stacklevel=3)
        return None
    damaged = _non_finite(tier)
    if damaged:  # quantize never writes one: the entry was damaged or edited
        warnings.warn(f"build_tier: the cached tier {path}: {damaged} holds a value that is not finite (NaN or inf); "
                      f"building it again", stacklevel=3)
        return None
    return tier


def _non_finite(tier: Tier) -> str | None:
    """The first ``projection.scales`` or ``.biases`` of ``tier`` holding a NaN or an inf, or None."""
    for name, weight in tier.weights.items():
        for field in ("scales", "biases"):
            if not np.isfinite(getattr(weight, field).astype(np.float32)).all():
                return f"{name}.{field}"
    return None


def _mismatch(tier: Tier, num_layers: int, num_experts: int,
              shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> str | None:
    """What in ``tier`` differs from the tier of experts of ``shapes`` would be, or None."""
    for name, (shape, dtype) in shapes.items():
        out, width = shape[:-1], shape[-1]
        leading = (num_layers, num_experts, *out)
        want = {"packed": (leading + (width * tier.bits // WORD_BITS,), np.dtype(np.uint32)),
                "scales": (leading + (width // tier.group_size,), scale_dtype(dtype)),
                "biases": (leading + (width // tier.group_size,), scale_dtype(dtype))}
        for field, (want_shape, want_dtype) in want.items():
            array = getattr(tier.weights[name], field)
            if array.shape != want_shape or array.dtype != want_dtype:
                return (f"{name}.{field} is {array.dtype.name}{list(array.shape)}, the request's "
                        f"{want_dtype.name}{list(want_shape)}")
    return None


def _from_arrays(cached, projections, bits: int, group_size: int) -> Tier:
    weights = {}
    for name in projections:
        fields = [cached[f"{name}.packed"]]
        for field in ("scales", "biases"):
            fields.append(cached[f"{name}.{field}"].view(SCALE_DTYPES[str(cached[f"{name}.{field}.dtype"])]))
        weights[name] = QuantizedWeight(*fields)
    return Tier(weights, bits, group_size)


def check_tier(tier: Tier, where: str = "tier") -> None:
    """Checks that every projection's arrays are one weight stack quantized with ``tier.bits`` and
    ``tier.group_size``: packed uint32 ``[L, E, out, words]``, scales and biases ``[L, E, out, groups]`` of
    one 16-bit dtype, ``words * 32 / bits == groups * group_size``.

    Raises:
        TierOptionError: ``tier`` is no :class:`Tier`, or naming the projection and ``bits``, ``group_size``,
            the dtype or the shape that disagrees.
    """
    if not isinstance(tier, Tier):
        raise TierOptionError(f"{where} must be a kq_host.tier.Tier, got {type(tier).__name__}")
    try:
        check_options(tier.bits, tier.group_size)
    except TierOptionError as error:
        raise TierOptionError(f"{where}: {error}") from None
    for name, weight in tier.weights.items():
        packed, scales, biases = (np.asarray(a) for a in weight)
        if packed.dtype != np.uint32 or packed.ndim != 4:
            raise TierOptionError(f"{where}: {name}.packed must be uint32 [L, E, out, words], got "
                                  f"{packed.dtype}{list(packed.shape)}")
        if scales.dtype not in SCALE_DTYPES.values() or biases.dtype != scales.dtype:
            raise TierOptionError(f"{where}: {name}'s scales and biases must share one 16-bit dtype (bfloat16 or "
                                  f"float16), got {scales.dtype} and {biases.dtype}")
        if scales.shape != biases.shape or scales.shape[:-1] != packed.shape[:-1]:
            raise TierOptionError(f"{where}: {name}.packed {list(packed.shape)}, scales {list(scales.shape)} and "
                                  f"biases {list(biases.shape)} must agree on every axis but the last")
        words, groups = packed.shape[-1], scales.shape[-1]
        if words * WORD_BITS % tier.bits or words * WORD_BITS // tier.bits != groups * tier.group_size:
            raise TierOptionError(f"{where}: {name}'s rows of {words} uint32 words at bits={tier.bits} do not hold "
                                  f"the {groups} groups of group_size={tier.group_size} its scales do; bits or "
                                  f"group_size disagrees with the arrays")
