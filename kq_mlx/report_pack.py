"""A token's reports, every layer's fields, packed into one int32 array of the graph (:mod:`kq_core.reports`).

On MLX's CUDA backend one kernel launch copies them all: a concatenation there launches a copy per
input, 5 L of them a token. Elsewhere (the CPU, Metal) each field is one concatenation over the
layers, converted once. Both give the same bits: ids as int32, scores as their float32 bits (bfloat16
and float16 widened exactly).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kq_core.reports import FLOAT_FIELDS, REPORT_FIELDS
from kq_core.validate import dtype_name
from kq_mlx.route_shed_mlx import implementation_for

# What the graph hands the packer, per layer: the report's fields, but for ``served``, which the packer
# derives from the scores and the weights the layer combined with (``mix``): the scores where ``mix > 0``,
# else +0.0, computed once over every layer.
INPUT_FIELDS = ("ids", "scores", "miss_ids", "miss_scores", "mix")
THREADS_PER_GROUP = 256
# The inputs one packing takes: on MLX-CUDA each is a kernel parameter of 8 bytes, and 480 of them stay within
# the 4 KB of parameters every CUDA version takes; more layers are packed in launches of this many inputs.
MAX_INPUTS_PER_LAUNCH = 480


def _input_name(field: str, layer: int) -> str:
    return f"{field}_{layer}"


def _as_int_bits(value: str) -> str:
    return f"__float_as_int(static_cast<float>({value}))"


@functools.lru_cache(maxsize=None)
def cuda_kernel(layers: int, dtypes: tuple[str, ...]):
    """The packing kernel for ``layers`` layers and the inputs' ``dtypes`` (built once per variant; MLX
    writes each input's type into the signature, and its JIT cache is keyed by the name, so the name
    carries the dtypes)."""
    names = [_input_name(field, layer) for field in INPUT_FIELDS for layer in range(layers)]
    lines = []
    for f, field in enumerate(REPORT_FIELDS):
        for layer in range(layers):
            if field == "served":
                score, mix = _input_name("scores", layer) + "[i]", _input_name("mix", layer) + "[i]"
                value = f"(static_cast<float>({mix}) > 0.0f ? {_as_int_bits(score)} : 0)"
            else:
                value = _input_name(field, layer) + "[i]"
                value = _as_int_bits(value) if field in FLOAT_FIELDS else f"static_cast<int32_t>({value})"
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


def one_launch() -> bool:
    """Whether :func:`pack` is one kernel launch on the default device (MLX-CUDA), where a concatenation
    of the layers' fields is a copy launched per input."""
    return implementation_for() == "cuda"


def pack(fields: dict[str, list[mx.array]]) -> mx.array:
    """``{field: one array per layer}`` (:data:`INPUT_FIELDS`, each ``[..., K]`` of one shape) -> int32
    ``[F, L, T, K]`` (:mod:`kq_core.reports`' layout), ``T`` the rows of one array: one launch on MLX-CUDA per
    :data:`MAX_INPUTS_PER_LAUNCH` inputs."""
    arrays = [fields[field] for field in INPUT_FIELDS]
    layers, shape = len(arrays[0]), arrays[0][0].shape
    if any(len(field) != layers or any(a.shape != shape for a in field) for field in arrays):
        raise ValueError(f"pack_reports: every layer's report fields ({', '.join(INPUT_FIELDS)}) must have one "
                         f"shape, got { {name: [tuple(a.shape) for a in field] for name, field in zip(INPUT_FIELDS, arrays)} }")
    per_launch = max(1, MAX_INPUTS_PER_LAUNCH // len(INPUT_FIELDS))
    parts = [_pack_layers([field[first:first + per_launch] for field in arrays])
             for first in range(0, layers, per_launch)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def _pack_layers(arrays: list[list[mx.array]]) -> mx.array:
    """:func:`pack` of the layers given (each field's arrays, in :data:`INPUT_FIELDS` order), in one launch on
    MLX-CUDA."""
    layers, shape = len(arrays[0]), arrays[0][0].shape
    k, n = shape[-1], arrays[0][0].size
    out_shape = (len(REPORT_FIELDS), layers, n // k if k else 0, k)
    if n > 0 and one_launch():
        kernel = cuda_kernel(layers, tuple(dtype_name(field[0]) for field in arrays))
        (packed,) = kernel(inputs=[a for field in arrays for a in field], grid=(n, 1, 1),
                           threadgroup=(min(THREADS_PER_GROUP, n), 1, 1), output_shapes=[out_shape],
                           output_dtypes=[mx.int32])
        return packed
    return pack_joined({name: mx.concatenate(field, axis=0) for name, field in zip(INPUT_FIELDS, arrays)}, layers)


def pack_joined(joined: dict[str, mx.array], layers: int) -> mx.array:
    """The packing of :func:`pack` (off MLX-CUDA) from each field already joined over the layers:
    ``{field of INPUT_FIELDS: [L x B, T, K]}`` (layer by layer along the first axis) -> int32 ``[F, L, N, K]``,
    ``N`` a layer's rows (``B x T``)."""
    k, n = joined["ids"].shape[-1], joined["ids"].size
    out_shape = (len(REPORT_FIELDS), layers, n // (k * layers) if k else 0, k)
    scores = joined["scores"].astype(mx.float32)
    converted = {"ids": joined["ids"].astype(mx.int32), "scores": scores.view(mx.int32),
                 "miss_ids": joined["miss_ids"].astype(mx.int32),
                 "miss_scores": joined["miss_scores"].astype(mx.float32).view(mx.int32),
                 "served": mx.where(joined["mix"] > 0, scores, 0.0).view(mx.int32)}
    return mx.concatenate([converted[name] for name in REPORT_FIELDS], axis=0).reshape(out_shape)
