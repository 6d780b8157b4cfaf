"""A token's reports, every layer's four arrays, packed into one int32 array of the graph.

On MLX's CUDA backend one kernel launch copies them all: a concatenation there launches a copy per
input, 4 L of them a token. Elsewhere (the CPU, Metal) each field is one concatenation over the
layers, converted once. Both give the same bits: ids as int32, scores as their float32 bits (bfloat16
and float16 widened exactly).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kq_core.validate import dtype_name
from kq_mlx.route_shed_mlx import implementation_for

FIELDS = ("ids", "scores", "miss_ids", "miss_scores")
# Fields packed as float32 bits; the others as int32 values.
FLOAT_FIELDS = ("scores", "miss_scores")
THREADS_PER_GROUP = 256


def _input_name(field: str, layer: int) -> str:
    return f"{field}_{layer}"


@functools.lru_cache(maxsize=None)
def cuda_kernel(layers: int, dtypes: tuple[str, ...]):
    """The packing kernel for ``layers`` layers and the fields' ``dtypes`` (built once per variant; MLX
    writes each input's type into the signature, and its JIT cache is keyed by the name, so the name
    carries the dtypes)."""
    names = [_input_name(field, layer) for field in FIELDS for layer in range(layers)]
    lines = []
    for f, field in enumerate(FIELDS):
        for layer in range(layers):
            value = _input_name(field, layer) + "[i]"
            value = (f"__float_as_int(static_cast<float>({value}))" if field in FLOAT_FIELDS
                     else f"static_cast<int32_t>({value})")
            lines.append(f"  packed[{f * layers + layer} * n + i] = {value};")
    first = names[0]
    body = "\n".join([
        "  long long n = 1;",
        f"  for (int d = 0; d < {first}_ndim; ++d) n *= {first}_shape[d];",
        "  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "  if (i >= n) return;",
        *lines,
    ])
    return mx.fast.cuda_kernel(name=f"kq_pack_reports_l{layers}_" + "_".join(dtypes), input_names=names,
                               output_names=["packed"], source=body, ensure_row_contiguous=True)


def pack(fields: dict[str, list[mx.array]]) -> mx.array:
    """``{field: one array per layer}`` (:data:`FIELDS`, each ``[..., K]`` of one shape) -> int32
    ``[4, L, T, K]``, ``T`` the rows of one array."""
    arrays = [fields[field] for field in FIELDS]
    layers, shape = len(arrays[0]), arrays[0][0].shape
    if any(len(field) != layers or any(a.shape != shape for a in field) for field in arrays):
        raise ValueError(f"pack_reports: every layer's ids, scores, miss ids and miss scores must have one shape, got "
                         f"{ {name: [tuple(a.shape) for a in field] for name, field in zip(FIELDS, arrays)} }")
    k, n = shape[-1], arrays[0][0].size
    if n > 0 and implementation_for() == "cuda":
        kernel = cuda_kernel(layers, tuple(dtype_name(field[0]) for field in arrays))
        (packed,) = kernel(inputs=[a for field in arrays for a in field], grid=(n, 1, 1),
                           threadgroup=(min(THREADS_PER_GROUP, n), 1, 1), output_shapes=[(4, layers, n // k, k)],
                           output_dtypes=[mx.int32])
        return packed

    def joined(field):  # [L x B, T, K]: layer-major, as the final reshape reads it
        return mx.concatenate(field, axis=0)

    def bits(field):
        return joined(field).astype(mx.float32).view(mx.int32)

    converted = [bits(field) if name in FLOAT_FIELDS else joined(field).astype(mx.int32)
                 for name, field in zip(FIELDS, arrays)]
    return mx.concatenate(converted, axis=0).reshape(4, layers, -1, k)
