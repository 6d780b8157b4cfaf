"""JAX backend of kq: ``route_shed`` for ``jax.jit`` MoE layers.

``route_shed`` picks the fused Pallas kernel on a GPU and the pure-jnp
reference elsewhere; both give the bits of ``shared/spec.json``. The Pallas
module is imported on first use.
"""

from kq_jax.api import default_impl, route_shed
from kq_jax.reference import RouteShed, route_shed_reference

__all__ = ["RouteShed", "default_impl", "route_shed", "route_shed_reference", "route_shed_pallas"]


def __getattr__(name):
    if name == "route_shed_pallas":
        from kq_jax.route_shed_pallas import route_shed_pallas

        return route_shed_pallas
    raise AttributeError(f"module 'kq_jax' has no attribute {name!r}")
