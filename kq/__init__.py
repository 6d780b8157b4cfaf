"""kq: ``route_shed`` for MoE engines that keep a bounded arena of experts resident.

The top of the house. ``kq.route_shed`` dispatches on the array type: NumPy
arrays go to the oracle, JAX arrays to :mod:`kq_jax`, MLX arrays to
:mod:`kq_mlx`; frameworks are imported only when an array of theirs arrives.
The contract lives in :mod:`kq_core`, the host side of an arena in
:mod:`kq_host`, and the applications here: the backend registry
(:mod:`kq.backends`), ``kq check``, ``kq bench``, ``kq demo`` and ``kq study``.
"""

from __future__ import annotations

import importlib

# kq_core's names are imported when first used (PEP 562), so `import kq.cli` (and `kq --help`) starts no NumPy
# extension: ml_dtypes alone takes over half a second of CPU.
_FROM_KQ_CORE = frozenset({
    "RouteShedArgumentError",
    "RouteShedDtypeError",
    "RouteShedInputError",
    "RouteShedResult",
    "TopkRouteShedResult",
    "check_route_shed_args",
    "route_shed_oracle",
    "topk_route_shed_oracle",
    "validate",
})

__version__ = "0.1.0"
__all__ = [
    "RouteShedArgumentError",
    "RouteShedDtypeError",
    "RouteShedInputError",
    "RouteShedResult",
    "TopkRouteShedResult",
    "check_route_shed_args",
    "route_shed",
    "route_shed_oracle",
    "topk_route_shed_oracle",
    "validate",
]


def __getattr__(name: str):
    if name in _FROM_KQ_CORE:
        value = getattr(importlib.import_module("kq_core"), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'kq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_KQ_CORE})


def _framework(array) -> str:
    module = type(array).__module__
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    if module.startswith("mlx"):
        return "mlx"
    return "numpy"


def route_shed(indices, scores, slot_table, **options):
    """Remaps routed expert ids to arena slots and sheds the non-resident ones.

    Args:
        indices: int32/uint32 ``[..., K]`` router top-k ids.
        scores: float32/bfloat16/float16 ``[..., K]`` gate scores.
        slot_table: int32 ``[E]``, negative = not resident.
        **options: passed to the framework's implementation: ``num_slots=``
            and ``on_miss=`` (``"shed"``, or ``"tier"``: misses served from a
            low-precision tier at slot ``num_slots + id``) on every framework,
            ``impl=`` for JAX, ``stream=`` for MLX.

    Returns:
        ``(slots, mix, miss_ids, miss_scores)`` as a NamedTuple of arrays of
        the inputs' framework: JAX's or MLX's where any input is one of its
        arrays (the others, NumPy arrays, taken as they are), else NumPy's.

    Raises:
        TypeError: the inputs mix JAX and MLX arrays.
    """
    frameworks = {_framework(array) for array in (indices, scores, slot_table)} - {"numpy"}
    if len(frameworks) > 1:
        raise TypeError(f"route_shed: indices, scores and slot_table mix {' and '.join(sorted(frameworks))} "
                        f"arrays; give one framework's (NumPy arrays go with either)")
    framework = frameworks.pop() if frameworks else "numpy"
    if framework == "jax":
        import kq_jax

        return kq_jax.route_shed(indices, scores, slot_table, **options)
    if framework == "mlx":
        import kq_mlx

        return kq_mlx.route_shed(indices, scores, slot_table, **options)
    unknown = set(options) - {"num_slots", "on_miss"}
    if unknown:
        raise TypeError(f"route_shed: the NumPy oracle takes only num_slots and on_miss, got {sorted(unknown)}")
    from kq_core import route_shed_oracle

    return route_shed_oracle(indices, scores, slot_table, **options)
