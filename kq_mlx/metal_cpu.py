"""Executes ``route_shed.metal`` on the CPU: the production kernel source, compiled by g++.

The translation unit is the shim (``harness/metal_shim.h``), the kernel header,
the signature MLX generates and the kernel body, all verbatim, plus a driver
that calls the kernel once per row as the GPU would once per thread, and a few
times past the last row so that the body's bounds check is exercised. Needs
only NumPy and a C++ compiler; builds are cached per variant.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from kq_core.contract import RouteShedResult
from kq_mlx import sources

COMPILE_FLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-Wno-attributes")
EXTRA_THREADS = 3  # threads launched past the last row, as a rounded-up grid would


class CompilerUnavailable(RuntimeError):
    """No C++ compiler that can build the harness."""


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        raise CompilerUnavailable("no C++ compiler (g++) on PATH")
    return found


def translation_unit(index_dtype: str, score_dtype: str, top_k: int, bound: int = sources.NO_SLOT_BOUND,
                     tier: bool = False) -> str:
    source = sources.load("route_shed.metal")
    name = sources.kernel_name(index_dtype, score_dtype, top_k, tier)
    id_t = sources.METAL_TYPES[index_dtype]
    score_t = sources.METAL_TYPES[score_dtype]
    return f"""#include "metal_shim.h"
{source.header}
{sources.metal_signature(index_dtype, score_dtype, top_k, tier)} {{
{source.body}
}}

extern "C" void kq_run(const {id_t}* indices, const int* indices_shape, const {score_t}* scores,
                       const int32_t* slot_table, const int* slot_table_shape, {id_t}* slots, float* mix,
                       int32_t* miss_ids, float* miss_scores) {{
  for (int row = 0; row < indices_shape[0] + {EXTRA_THREADS}; row++) {{
    custom_kernel_{name}<{id_t}, {score_t}, {top_k}, {bound}, {int(tier)}>(indices, indices_shape, scores, slot_table,
        slot_table_shape, slots, mix, miss_ids, miss_scores, uint3{{uint(row), 0u, 0u}});
  }}
}}
"""


def _cache_dir() -> Path:
    root = os.environ.get("KQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kq")
    path = Path(root) / "metal_cpu"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def build(index_dtype: str, score_dtype: str, top_k: int, bound: int = sources.NO_SLOT_BOUND,
          tier: bool = False) -> ctypes.CDLL:
    """Compiles (once per variant and source) and loads the harness library."""
    unit = translation_unit(index_dtype, score_dtype, top_k, bound, tier)
    shim = (resources.files("kq_mlx") / "harness" / "metal_shim.h").read_text()
    digest = hashlib.sha256((unit + shim + " ".join(COMPILE_FLAGS)).encode()).hexdigest()[:16]
    library = _cache_dir() / f"route_shed_metal_{index_dtype}_{score_dtype}_k{top_k}_s{bound}_t{int(tier)}_{digest}.so"
    if not library.exists():
        with tempfile.TemporaryDirectory() as work:
            src = Path(work) / "route_shed_metal.cpp"
            src.write_text(unit)
            (Path(work) / "metal_shim.h").write_text(shim)
            built = Path(work) / library.name
            done = subprocess.run([compiler(), *COMPILE_FLAGS, "-I", work, "-o", str(built), str(src)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building the Metal source on the CPU failed:\n{done.stderr}")
            shutil.move(str(built), library)  # atomic within one filesystem; fine across test workers
    return ctypes.CDLL(str(library))


def prepare(indices, scores, slot_table, num_slots: int | None = None, on_miss: str = "shed"):
    """Builds the variant and the buffers; returns ``(launch, collect)``.

    ``launch()`` runs the kernel over every row (and past the last one);
    ``collect()`` checks the guard bands and returns the outputs. Split so that
    ``kq bench`` can time the native loop alone.
    """
    out_shape = np.shape(indices)
    host = sources.host_inputs(indices, scores, slot_table, num_slots, on_miss)
    indices, scores, slot_table, index_dtype, score_dtype, top_k, rows = host[:7]
    run = build(index_dtype, score_dtype, top_k, host.slot_bound, host.tier).kq_run

    # Outputs get a guard band on both sides: a thread past the last row that
    # wrote anything would change it.
    guard = (EXTRA_THREADS + 1) * top_k
    outputs = [np.full(rows * top_k + 2 * guard, 0x5A, dtype=sources.HOST_TYPES[d])
               for d in sources.output_dtypes(index_dtype)]
    sentinels = [o.copy() for o in outputs]
    indices_shape = np.array([rows, top_k], np.int32)
    table_shape = np.array(slot_table.shape, np.int32)

    def ptr(array):
        return array.ctypes.data_as(ctypes.c_void_p)

    arguments = (ptr(indices), ptr(indices_shape), ptr(scores), ptr(slot_table), ptr(table_shape),
                 *(ctypes.c_void_p(o.ctypes.data + guard * o.itemsize) for o in outputs))

    def launch() -> None:
        run(*arguments)

    def collect() -> RouteShedResult:
        body = slice(guard, guard + rows * top_k)
        for out, before in zip(outputs, sentinels):
            outside = np.concatenate([out[:body.start], out[body.stop:]]).view(np.uint8)
            if not np.array_equal(outside, np.concatenate([before[:body.start], before[body.stop:]]).view(np.uint8)):
                raise RuntimeError("route_shed.metal wrote outside its rows: the bounds check failed")
        return RouteShedResult(*(o[body].reshape(out_shape) for o in outputs))

    return launch, collect


def route_shed_metal_cpu(indices, scores, slot_table, *, num_slots: int | None = None,
                         on_miss: str = "shed") -> RouteShedResult:
    """Runs the Metal kernel source on the CPU, one call per row (NumPy in, NumPy out).

    Args:
        indices: int32/uint32 ``[..., K]``; scores: float32/bfloat16/float16
            ``[..., K]``; slot_table: int32 ``[E]``; num_slots: the arena's slot count, or None;
            on_miss: ``"shed"`` or ``"tier"``.

    Returns:
        ``RouteShedResult`` as the kernel wrote it.
    """
    launch, collect = prepare(indices, scores, slot_table, num_slots, on_miss)
    launch()
    return collect()
