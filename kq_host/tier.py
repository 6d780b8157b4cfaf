"""The low-precision tier: every expert of every layer, quantized, beside the full-precision arena.

With ``route_shed(..., on_miss="tier")`` a routed expert that is not in the arena is computed with
its copy here instead of being dropped. The format is affine group quantization in MLX's layout
(what ``mx.quantize`` returns and ``mx.gather_qmm`` reads): along each weight row's input axis,
``group_size`` values share a ``scale`` and a ``bias``, and ``w ~= scale * q + bias`` with
``q`` in ``[0, 2**bits)``, the q of a row packed as one little-endian bit stream into uint32
words. A JAX layer dequantizes the rows it gathers; an MLX layer hands the arrays to
``gather_qmm`` as they are. Built once from an :class:`~kq_host.expert_store.ExpertStore`
and cached on disk, keyed by the checkpoint's files and the options.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

import ml_dtypes
import numpy as np

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)
# The packing word: q values run through uint32 words as one little-endian bit stream.
WORD_BITS = 32
_CACHE_VERSION = "1"


class TierOptionError(ValueError):
    """An option of the tier (bits, group size, a weight's shape) is not one the format takes."""


class QuantizedWeight(NamedTuple):
    """One weight (or a stack of them) in the tier's format.

    Attributes:
        packed: uint32 ``[..., out, in * bits / 32]``.
        scales: ``[..., out, in / group_size]``, the weight's dtype (float32, bfloat16 or float16).
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
    if not (isinstance(bits, (int, np.integer)) and not isinstance(bits, bool) and bits in BITS):
        raise TierOptionError(f"tier: bits must be one of {BITS}, got {bits!r}")
    if not (isinstance(group_size, (int, np.integer)) and not isinstance(group_size, bool)
            and group_size in GROUP_SIZES):
        raise TierOptionError(f"tier: group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def quantize(weight: np.ndarray, *, bits: int, group_size: int) -> QuantizedWeight:
    """Affine group quantization of ``weight`` ``[..., in]`` along its last axis.

    Per group: ``bias = min``, ``scale = (max - min) / (2**bits - 1)``, both rounded to the weight's
    dtype first (a float32 scale to 16 significant bits, so ``scale * q`` is exact); then ``q = clip(rint((w - bias) / scale), 0, 2**bits - 1)`` (0 where ``scale`` is 0).

    Args:
        weight: float32, bfloat16 or float16 ``[..., in]``, ``in`` a multiple of ``group_size``.
        bits: 2, 3, 4 or 8.
        group_size: 32, 64 or 128.

    Returns:
        :class:`QuantizedWeight`, scales and biases in ``weight``'s dtype.

    Raises:
        TierOptionError: an option or the shape the format does not take.
    """
    check_options(bits, group_size)
    weight = np.asarray(weight)
    if weight.ndim < 1 or weight.shape[-1] % group_size:
        raise TierOptionError(f"tier: a weight's last axis must be a multiple of group_size={group_size}, "
                              f"got shape {weight.shape}")
    if not np.all(np.isfinite(weight.astype(np.float32))):
        raise TierOptionError("tier: a weight to quantize holds inf or NaN")
    groups = weight.astype(np.float32).reshape(*weight.shape[:-1], -1, group_size)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    levels = (1 << bits) - 1
    biases = low.astype(weight.dtype)
    scales = _short_significand(((high - low) / np.float32(levels)).astype(weight.dtype))
    scale32, bias32 = scales.astype(np.float32)[..., None], biases.astype(np.float32)[..., None]
    q = np.rint((groups - bias32) / np.where(scale32 > 0, scale32, np.float32(1.0)))
    q = np.where(scale32 > 0, np.clip(q, 0, levels), 0).astype(np.uint32)
    return QuantizedWeight(pack(q.reshape(weight.shape), bits), scales, biases)


# Scales carry at most this many significant bits, so that scale * q (q < 2**8) is exact in float32:
# a backend that fuses the multiply and the add into an FMA then rounds exactly as one that does not.
SCALE_SIGNIFICANT_BITS = 16


def _short_significand(scales: np.ndarray) -> np.ndarray:
    """float32 scales rounded to :data:`SCALE_SIGNIFICANT_BITS` significant bits (bf16 and f16 have fewer)."""
    if scales.dtype != np.float32:
        return scales
    mantissa, exponent = np.frexp(scales.astype(np.float64))
    return np.ldexp(np.round(mantissa * 2.0**SCALE_SIGNIFICANT_BITS) / 2.0**SCALE_SIGNIFICANT_BITS,
                    exponent).astype(np.float32)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint32 ``[..., n * bits / 32]``: ``q`` ``[..., n]`` (each < 2**bits) as a little-endian bit stream."""
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)  # [..., n, bits]
    packed = np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack`: uint32 ``[..., n]`` values."""
    packed = np.asarray(packed, dtype=np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:  # whole values per word: shift each word
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        return ((packed[..., None] >> shifts) & mask).reshape(*packed.shape[:-1], -1)
    # a value may straddle two words: read each value from the 64 bits of its word and the next
    start = np.arange(packed.shape[-1] * 32 // bits, dtype=np.int64) * bits
    word, offset = start // 32, (start % 32).astype(np.uint64)
    wide = np.concatenate([packed, np.zeros((*packed.shape[:-1], 1), np.uint32)], axis=-1).astype(np.uint64)
    pairs = wide[..., word] | (wide[..., word + 1] << np.uint64(32))
    return ((pairs >> offset) & np.uint64(mask)).astype(np.uint32)


def dequantize(weight: QuantizedWeight, *, bits: int, group_size: int) -> np.ndarray:
    """float32 ``[..., in]``: ``scale * q + bias`` per group, in float32 (the reference of the layers)."""
    q = unpack(weight.packed, bits).astype(np.float32)
    groups = q.reshape(*q.shape[:-1], -1, group_size)
    values = groups * weight.scales.astype(np.float32)[..., None] + weight.biases.astype(np.float32)[..., None]
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


def build_tier(store, num_layers: int, num_experts: int, *, bits: int = 3, group_size: int = 32,
               cache_dir: str | os.PathLike | None = None) -> Tier:
    """Quantizes every expert the store holds, or loads the cached result of the same build.

    Args:
        store: an :class:`~kq_host.expert_store.ExpertStore`.
        num_layers, num_experts: L and E of the checkpoint.
        bits, group_size: as for :func:`quantize`.
        cache_dir: where built tiers are kept (``None``: ``$KQ_CACHE_DIR/tier`` or
            ``~/.cache/kq/tier``); the key is every tensor's file identity, place and size, and the options.

    Returns:
        :class:`Tier` with leading dims ``[num_layers, num_experts]``.
    """
    check_options(bits, group_size)
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
            raise TierOptionError(f"tier: {name} must be an int >= 1, got {value!r}")
    path = _cache_path(store, num_layers, num_experts, bits, group_size, cache_dir)
    if path.exists():
        with np.load(path) as cached:
            return _from_arrays(cached, store.projections, bits, group_size)
    per_projection: dict[str, list[list[QuantizedWeight]]] = {p: [] for p in store.projections}
    for layer in range(num_layers):
        rows = {p: [] for p in store.projections}
        for expert in range(num_experts):
            for name, weight in store.read_expert(layer, expert).items():
                rows[name].append(quantize(weight, bits=bits, group_size=group_size))
        for name in store.projections:
            per_projection[name].append(rows[name])
    weights = {name: QuantizedWeight(*(np.stack([np.stack([getattr(w, field) for w in layer]) for layer in layers])
                                       for field in QuantizedWeight._fields))
               for name, layers in per_projection.items()}
    _save(path, weights)
    return Tier(weights, bits, group_size)


def _cache_path(store, num_layers, num_experts, bits, group_size, cache_dir) -> Path:
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("KQ_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kq") / "tier"
    key = hashlib.sha256(repr((_CACHE_VERSION, num_layers, num_experts, bits, group_size, store.projections,
                               store.template, store.layout,
                               sorted((name, str(e.path.resolve()), e.identity, e.offset, e.nbytes)
                                      for name, e in store.tensors.items()))).encode()).hexdigest()[:20]
    return root / f"tier_{bits}bit_g{group_size}_{key}.npz"


def _save(path: Path, weights: Mapping[str, QuantizedWeight]) -> None:
    """Writes the tier atomically (a temporary file renamed), scales and biases as their raw bits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, weight in weights.items():
        arrays[f"{name}.packed"] = weight.packed
        for field in ("scales", "biases"):
            array = getattr(weight, field)
            arrays[f"{name}.{field}"] = array.view(np.uint16) if array.dtype.itemsize == 2 else array
            arrays[f"{name}.{field}.dtype"] = np.array(array.dtype.name)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as out:
        np.savez(out, **arrays)
    os.replace(temporary, path)


def _from_arrays(cached, projections, bits: int, group_size: int) -> Tier:
    dtypes = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
              "float32": np.dtype(np.float32)}
    weights = {}
    for name in projections:
        fields = [cached[f"{name}.packed"]]
        for field in ("scales", "biases"):
            fields.append(cached[f"{name}.{field}"].view(dtypes[str(cached[f"{name}.{field}.dtype"])]))
        weights[name] = QuantizedWeight(*fields)
    return Tier(weights, bits, group_size)
