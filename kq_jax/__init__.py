"""JAX backend of kq: ``route_shed`` for ``jax.jit`` MoE layers.

``route_shed`` picks the fused Pallas kernel on a GPU and the pure-jnp
reference elsewhere; both give the bits of ``shared/spec.json``.
``topk_route_shed`` does the router's top-k and normalisation in the same
launch. The Pallas module is imported on first use.
"""

from kq_jax.api import default_impl, route_shed, topk_route_shed
from kq_jax.reference import RouteShed, TopkRouteShed, route_shed_reference, topk_route_shed_reference

__all__ = ["RouteShed", "TopkRouteShed", "default_impl", "route_shed", "route_shed_pallas", "route_shed_reference",
           "topk_route_shed", "topk_route_shed_pallas", "topk_route_shed_reference"]


def __getattr__(name):
    if name in ("route_shed_pallas", "topk_route_shed_pallas"):
        from kq_jax import route_shed_pallas

        return getattr(route_shed_pallas, name)
    raise AttributeError(f"module 'kq_jax' has no attribute {name!r}")
