"""MLX backend of kq: ``route_shed`` as a lazy op for MLX decode engines.

Metal kernel on Apple silicon, CUDA twin on MLX's CUDA backend, pure-``mx``
ops on CPU streams; all bit-exact with ``shared/spec.json``. MLX is imported
on first use, so the kernel sources and their CPU/CuPy harnesses
(``kq_mlx.metal_cpu``, ``kq_mlx.cuda_cupy``) work without MLX installed.
"""

__all__ = ["RouteShedResult", "TopkRouteShedResult", "from_numpy", "implementation_for", "route_shed", "route_shed_ops",
           "topk_route_shed"]


def __getattr__(name):
    if name in ("RouteShedResult", "TopkRouteShedResult"):
        from kq_core import contract

        return getattr(contract, name)
    if name in __all__:
        from kq_mlx import route_shed_mlx as module

        return getattr(module, name)
    raise AttributeError(f"module 'kq_mlx' has no attribute {name!r}")
