"""Executes ``route_shed.cu`` (the MLX CUDA twin) on an NVIDIA GPU through CuPy/NVRTC.

For NVIDIA machines without MLX's CUDA backend, this harness compiles the
same header and body strings with NVRTC's default options (which contract
multiply-adds: the source's explicit ``__f*_rn`` intrinsics are what keep it
exact), launches one thread per row on a grid rounded up to whole blocks, and
checks guard bands around every output for writes past the last row.
"""

from __future__ import annotations

import functools

import numpy as np

from kq_core.contract import RouteShedResult
from kq_mlx import sources

BLOCK = 256
_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
"""


def translation_unit(index_dtype: str, score_dtype: str, top_k: int, bound: int = sources.NO_SLOT_BOUND,
                     tier: bool = False) -> str:
    source = sources.load("route_shed.cu")
    signature = sources.cuda_harness_signature(index_dtype, score_dtype, top_k, bound, tier)
    return (f"{_PRELUDE}{source.header}\n{signature}\n"
            f"{source.body}\n}}\n")


@functools.lru_cache(maxsize=None)
def build(index_dtype: str, score_dtype: str, top_k: int, bound: int = sources.NO_SLOT_BOUND, tier: bool = False):
    import cupy

    module = cupy.RawModule(code=translation_unit(index_dtype, score_dtype, top_k, bound, tier),
                            options=("--std=c++17",))
    return module.get_function("kq_route_shed")


def route_shed_cuda_cupy(indices, scores, slot_table, *, num_slots: int | None = None,
                         on_miss: str = "shed") -> RouteShedResult:
    """Runs the CUDA twin on the GPU (NumPy in, NumPy out)."""
    import cupy

    out_shape = np.shape(indices)
    host = sources.host_inputs(indices, scores, slot_table, num_slots, on_miss)
    indices, scores, slot_table, index_dtype, score_dtype, top_k, rows = host[:7]
    guard = BLOCK * top_k
    outputs = [cupy.full(rows * top_k + 2 * guard, 0x5A, dtype=sources.HOST_TYPES[d])
               for d in sources.output_dtypes(index_dtype)]
    if rows:
        kernel = build(index_dtype, score_dtype, top_k, host.slot_bound, host.tier)
        args = (cupy.asarray(indices.reshape(-1)), cupy.asarray(np.array([rows, top_k], np.int32)),
                cupy.asarray(scores.reshape(-1)), cupy.asarray(slot_table),
                cupy.asarray(np.array(slot_table.shape, np.int32)), *(o[guard:guard + rows * top_k] for o in outputs))
        kernel(((rows + BLOCK - 1) // BLOCK,), (BLOCK,), args)
    written = [cupy.asnumpy(o) for o in outputs]
    for out in written:
        untouched = np.concatenate([out[:guard], out[guard + rows * top_k:]])
        if not np.all(untouched == out.dtype.type(0x5A)):
            raise RuntimeError("route_shed.cu wrote outside its rows: the bounds check failed")
    return RouteShedResult(*(o[guard:guard + rows * top_k].reshape(out_shape) for o in written))
