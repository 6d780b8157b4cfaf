"""The kernel sources of kq_mlx and the signatures MLX wraps around them.

Both kernels run one row loop, ``route_shed_row.inc``, split at
``// ==== helpers ====`` and ``// ==== body ====``. A kernel's header is the
contract's constants (from :mod:`kq_core.contract`), the language's own
header (``route_shed.metal`` or ``route_shed.cu``: the macros and index types
the loop uses), the integer multiply both share (``ieee_f32.inc``) and the
loop's helpers; its body is the loop. The same strings go to
``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` and to the harnesses that
execute them where the hardware is missing, together with a signature written
the way MLX writes it, so what is tested is what MLX compiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple

import numpy as np

from kq_core.contract import CANONICAL_NAN_BITS, F32_MIN_NORMAL, NAN_ORDER_KEY
from kq_core.validate import check_route_shed_args, dtype_name

INPUT_NAMES = ("indices", "scores", "slot_table")
OUTPUT_NAMES = ("slots", "mix", "miss_ids", "miss_scores")
# Which inputs the bodies read the shape of (MLX passes `<name>_shape` then).
SHAPED_INPUTS = ("indices", "slot_table")

METAL_TYPES = {"int32": "int32_t", "uint32": "uint32_t", "float32": "float", "bfloat16": "bfloat16_t",
               "float16": "float16_t"}
CUDA_TYPES = {"int32": "int32_t", "uint32": "uint32_t", "float32": "float", "bfloat16": "__nv_bfloat16",
              "float16": "__half"}


# NumPy storage of each dtype as the harnesses hand it to a kernel (bf16 as its bits).
HOST_TYPES = {"int32": np.int32, "uint32": np.uint32, "float32": np.float32, "bfloat16": np.uint16,
              "float16": np.float16}


# The kernels' slot bound S when the caller gives no num_slots: every non-negative entry is resident.
NO_SLOT_BOUND = 2**31 - 1


def slot_bound(num_slots: int | None) -> int:
    """The kernels' template constant S for ``num_slots``."""
    return NO_SLOT_BOUND if num_slots is None else int(num_slots)


def tier_base(num_slots: int | None, on_miss: str) -> int | None:
    """The first tier slot (S) with ``on_miss="tier"``; None when misses are shed."""
    return int(num_slots) if on_miss == "tier" else None


class HostInputs(NamedTuple):
    """Checked, contiguous host inputs of a harness launch, with the variant they select."""

    indices: np.ndarray
    scores: np.ndarray  # viewed as HOST_TYPES[score_dtype]
    slot_table: np.ndarray
    index_dtype: str
    score_dtype: str
    top_k: int
    rows: int
    slot_bound: int
    tier: bool


def host_inputs(indices, scores, slot_table, num_slots: int | None = None, on_miss: str = "shed") -> HostInputs:
    """Checks the arguments (before any conversion) and lays them out for a kernel harness."""
    check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
    indices, scores, slot_table = (np.asarray(a) for a in (indices, scores, slot_table))
    index_dtype, score_dtype = dtype_name(indices), dtype_name(scores)
    top_k = indices.shape[-1]
    return HostInputs(np.ascontiguousarray(indices),
                      np.ascontiguousarray(scores).view(HOST_TYPES[score_dtype]),
                      np.ascontiguousarray(slot_table), index_dtype, score_dtype, top_k, indices.size // top_k,
                      slot_bound(num_slots), on_miss == "tier")


@dataclass(frozen=True)
class KernelSource:
    header: str
    body: str


def constants_header() -> str:
    """The contract's constants as the kernels' preprocessor definitions."""
    return (f"#define KQ_MIN_NORMAL {F32_MIN_NORMAL!r}f  // 2^-126\n"
            f"#define KQ_CANONICAL_NAN 0x{CANONICAL_NAN_BITS:08X}u\n"
            f"#define KQ_NAN_ORDER_KEY 0x{NAN_ORDER_KEY:08X}\n")


@functools.lru_cache(maxsize=None)
def load(filename: str) -> KernelSource:
    """Header and body of the kernel for ``route_shed.metal`` or ``route_shed.cu``."""
    package = resources.files("kq_mlx")
    _, rest = (package / "route_shed_row.inc").read_text().split("// ==== helpers ====\n", 1)
    helpers, body = rest.split("// ==== body ====\n", 1)
    header = "\n".join((constants_header(), (package / filename).read_text(),
                        (package / "ieee_f32.inc").read_text(), helpers))
    return KernelSource(header=header, body=body)


def kernel_name(index_dtype: str, score_dtype: str, top_k: int, tier: bool = False) -> str:
    """One name per variant: MLX caches compiled libraries by name."""
    return f"kq_route_shed_{index_dtype}_{score_dtype}_k{top_k}{'_tier' if tier else ''}"


def output_dtypes(index_dtype: str) -> tuple[str, ...]:
    return (index_dtype, "float32", "int32", "float32")


def metal_signature(index_dtype: str, score_dtype: str, top_k: int, tier: bool = False) -> str:
    """The function MLX's metal_kernel generates around the body (template form)."""
    types = dict(zip(INPUT_NAMES, (index_dtype, score_dtype, "int32")))
    params, buffer = [], 0
    for name in INPUT_NAMES:
        params.append(f"const device {METAL_TYPES[types[name]]}* {name} [[buffer({buffer})]]")
        buffer += 1
        if name in SHAPED_INPUTS:
            params.append(f"const constant int* {name}_shape [[buffer({buffer})]]")
            buffer += 1
    for name, dtype in zip(OUTPUT_NAMES, output_dtypes(index_dtype)):
        params.append(f"device {METAL_TYPES[dtype]}* {name} [[buffer({buffer})]]")
        buffer += 1
    params.append("uint3 thread_position_in_grid [[thread_position_in_grid]]")
    joined = ",\n  ".join(params)
    return (f"template <typename IdT, typename ScoreT, int K, int S, int TIER>\n"
            f"[[kernel]] void custom_kernel_{kernel_name(index_dtype, score_dtype, top_k, tier)}(\n  {joined})")


def template_args(index_dtype: str, score_dtype: str, top_k: int, bound: int = NO_SLOT_BOUND, tier: bool = False):
    """Template arguments for either kernel, as (name, dtype name or int) pairs; ``bound`` is S, ``tier``
    (``on_miss="tier"``) TIER = 1."""
    return (("IdT", index_dtype), ("ScoreT", score_dtype), ("K", top_k), ("S", bound), ("TIER", int(tier)))


def cuda_harness_signature(index_dtype: str, score_dtype: str, top_k: int, bound: int = NO_SLOT_BOUND,
                           tier: bool = False) -> str:
    """MLX's cuda_kernel signature, with each ``Shape`` passed as a device pointer.

    MLX passes ``<name>_shape`` by value as a ``__grid_constant__ Shape``; the
    CuPy harness passes ``const int*`` instead. The body only indexes it
    (``indices_shape[0]``), which reads the same either way.
    """
    types = dict(zip(INPUT_NAMES, (index_dtype, score_dtype, "int32")))
    params = []
    for name in INPUT_NAMES:
        params.append(f"const {CUDA_TYPES[types[name]]}* {name}")
        if name in SHAPED_INPUTS:
            params.append(f"const int* {name}_shape")
    for name, dtype in zip(OUTPUT_NAMES, output_dtypes(index_dtype)):
        params.append(f"{CUDA_TYPES[dtype]}* {name}")
    constants = "".join(
        f"  constexpr int {n} = {v};\n" if isinstance(v, int) else f"  using {n} = {CUDA_TYPES[v]};\n"
        for n, v in template_args(index_dtype, score_dtype, top_k, bound, tier))
    joined = ",\n    ".join(params)
    return f'extern "C" __global__ void kq_route_shed(\n    {joined}) {{\n{constants}'
