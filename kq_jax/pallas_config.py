"""Launch configuration of the Pallas kernels: which kernel, how rows move, the launch shape.

Every choice is made here, in :func:`block_config` (``route_shed``) and
:func:`topk_block_config` (``topk_route_shed``); the rules and the H200
measurements behind each threshold are in docs/kernels.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from kq_core.validate import is_int

# The largest K the kernels unroll over a row's entries: the row kernel's
# second pass (a loop above it), tiled I/O (refused above it) and the topk
# kernel (XLA's top-k above it).
MAX_UNROLLED_K = 16
# The strided row kernel's rows per program grow from one warp to 256 rows
# only once the grid has _TARGET_PROGRAMS programs (two per SM on an H200).
_MIN_BLOCK_ROWS = 32
_MAX_BLOCK_ROWS = 256
_TARGET_PROGRAMS = 264
# Up to _LANES_MAX_ROWS rows the entry-lanes kernel is the default, up to
# _STRIDED_MAX_ROWS the strided row kernel, above it tiled I/O.
_LANES_MAX_ROWS = 8
_STRIDED_MAX_ROWS = 4096
# topk_route_shed: rows per program, and experts per warp.
_TOPK_BLOCK_ROWS = 1
_TOPK_EXPERTS_PER_WARP = 1024


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_bucket(rows: int) -> int:
    """The rows a kernel launches on for ``rows`` rows: the next of 1, 2, 3, 4, 6, 8, 12, ... (2^p and 3 * 2^(p-1)).

    Two kernels per power of two, so a server that meets every row count up
    to 2^20 compiles at most 41 per op; the padding is under half the rows.
    """
    if rows <= 2:
        return rows
    power = next_power_of_two(rows)
    return power * 3 // 4 if rows <= power * 3 // 4 else power


class KernelConfig(NamedTuple):
    """Launch parameters; ``None`` fields are chosen by :func:`block_config` / :func:`topk_block_config`.

    Attributes:
        block_rows: rows per program, a power of two.
        num_warps: warps per program.
        tiled_io: move a program's rows between memory and registers as
            ``[block_rows, KP]`` tiles (coalesced) instead of one strided
            4-byte access per entry; K <= 16 only.
        ptx_arith: round ``s * scale`` and ``total / kept`` with PTX's IEEE
            ``mul.rn.f32`` / ``div.rn.f32`` (inline assembly) instead of the
            integer mantissa arithmetic of :mod:`kq_jax.ieee_f32`; CUDA only.
        entry_lanes: one lane per entry, each lane counting its own entry's
            rank in a loop over the row, instead of one thread per row.
        row_buckets: launch on :func:`row_bucket` rows (the rows padded, the
            padding's outputs dropped), so that row counts share compiled
            kernels; ``False`` compiles a kernel for the exact row count.
    """

    block_rows: int | None = None
    num_warps: int | None = None
    tiled_io: bool | None = None
    ptx_arith: bool | None = None
    entry_lanes: bool | None = None
    row_buckets: bool | None = None


def _on_cuda() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and "rocm" not in device.client.platform_version.lower()


def block_config(rows: int, top_k: int, config: KernelConfig | None = None, *,
                 interpret: bool = False) -> KernelConfig:
    """Resolves every field of ``config`` for ``route_shed`` on ``[rows, top_k]`` entries.

    Defaults: entry lanes up to 8 rows and for K > 16 (programs of 32 rows and
    one warp, or 8 rows and two warps past K = 16); the strided row kernel up
    to 4096 rows; tiled I/O above (one warp of 32 rows per program, 128 rows
    and 4 warps at K <= 4); PTX rounding on a CUDA GPU. ``config`` overrides
    any choice. The interpreter has no PTX, so ``interpret`` rules out
    ``ptx_arith``.

    Raises:
        ValueError: ``config`` asks for two kernels at once, tiled I/O past
            K = 16, a block that is not a power of two, or PTX in the interpreter.
    """
    config = checked_config("route_shed_pallas", config)
    entry_lanes = config.entry_lanes
    if entry_lanes is None:
        entry_lanes = (rows <= _LANES_MAX_ROWS or top_k > MAX_UNROLLED_K) and not config.tiled_io
    if entry_lanes and config.tiled_io:
        raise ValueError("route_shed_pallas: entry_lanes and tiled_io are two different kernels; pick one")
    tiled_io = config.tiled_io
    if tiled_io is None:
        tiled_io = top_k <= MAX_UNROLLED_K and rows > _STRIDED_MAX_ROWS and not entry_lanes
    if tiled_io and top_k > MAX_UNROLLED_K:
        raise ValueError(f"route_shed_pallas: tiled_io needs K <= {MAX_UNROLLED_K}, got K = {top_k}")
    ptx_arith = _resolve_ptx_arith("route_shed_pallas", config, interpret)
    if entry_lanes:
        wanted = 32 if top_k <= MAX_UNROLLED_K else 8
    elif tiled_io:
        wanted = 128 if top_k <= 4 else 32
    else:
        wanted = min(_MAX_BLOCK_ROWS, max(_MIN_BLOCK_ROWS, next_power_of_two(-(-max(rows, 1) // _TARGET_PROGRAMS))))
    block_rows = _block_rows("route_shed_pallas", config.block_rows or wanted, rows)
    if entry_lanes:
        num_warps = 1 if top_k <= MAX_UNROLLED_K else 2
    else:
        num_warps = max(1, min(8, block_rows // 32))
    num_warps = config.num_warps or num_warps
    return KernelConfig(block_rows, num_warps, tiled_io, ptx_arith, entry_lanes, config.row_buckets is not False)


def topk_block_config(rows: int, num_experts: int, config: KernelConfig | None = None, *,
                      interpret: bool = False) -> KernelConfig:
    """Resolves ``config`` for ``topk_route_shed``'s kernel on ``[rows, num_experts]`` probabilities.

    Defaults: one row per program and one warp, a warp more per 1024 experts
    (up to 4). Only ``block_rows``, ``num_warps`` and ``ptx_arith`` apply: the
    kernel has one layout.

    Raises:
        ValueError: ``config`` asks for tiled I/O or entry lanes, or as for :func:`block_config`.
    """
    config = checked_config("topk_route_shed_pallas", config)
    if config.tiled_io or config.entry_lanes:
        raise ValueError("topk_route_shed_pallas: tiled_io and entry_lanes are route_shed's kernels, not this one's")
    ptx_arith = _resolve_ptx_arith("topk_route_shed_pallas", config, interpret)
    block_rows = _block_rows("topk_route_shed_pallas", config.block_rows or _TOPK_BLOCK_ROWS, rows)
    row_warps = block_rows * next_power_of_two(num_experts) // _TOPK_EXPERTS_PER_WARP
    num_warps = config.num_warps or max(1, min(4, row_warps))
    return KernelConfig(block_rows, num_warps, False, ptx_arith, False, config.row_buckets is not False)


def checked_config(op: str, config) -> KernelConfig:
    """``config`` (None: every field chosen) as a :class:`KernelConfig` whose given fields are of their kind:
    ``block_rows`` and ``num_warps`` powers of two >= 1, the rest bools; ValueError naming the field."""
    if config is None:
        return KernelConfig()
    if not isinstance(config, KernelConfig):
        raise ValueError(f"{op}: config must be a kq_jax.pallas_config.KernelConfig or None, got "
                         f"{type(config).__name__}")
    for name in ("block_rows", "num_warps"):
        value = getattr(config, name)
        if value is not None and (not is_int(value) or value < 1
                                  or value & (value - 1)):
            raise ValueError(f"{op}: config.{name} must be None or a power of two >= 1, got {value!r}")
    for name in ("tiled_io", "ptx_arith", "entry_lanes", "row_buckets"):
        if getattr(config, name) not in (None, True, False):
            raise ValueError(f"{op}: config.{name} must be None or a bool, got {getattr(config, name)!r}")
    return config


def _resolve_ptx_arith(op: str, config: KernelConfig, interpret: bool) -> bool:
    """``config.ptx_arith``, by default on a CUDA GPU; refused by the interpreter, which has no PTX."""
    ptx_arith = (not interpret and _on_cuda()) if config.ptx_arith is None else config.ptx_arith
    if ptx_arith and interpret:
        raise ValueError(f"{op}: ptx_arith is inline PTX, which the interpreter cannot run")
    return ptx_arith


def _block_rows(op: str, block_rows: int, rows: int) -> int:
    """A power-of-two block, clamped to the rows there are."""
    if block_rows & (block_rows - 1):
        raise ValueError(f"{op}: block_rows must be a power of two, got {block_rows}")
    return min(block_rows, next_power_of_two(max(rows, 1)))
