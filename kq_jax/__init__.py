"""JAX backend of kq: ``route_shed`` for ``jax.jit`` MoE layers.

``route_shed`` picks the fused Pallas kernel on a GPU and the pure-jnp
reference elsewhere; both give the bits of ``shared/spec.json``.
``topk_route_shed`` does the router's top-k and normalisation in the same
launch. The Pallas kernels (:mod:`kq_jax.route_shed_pallas`,
:mod:`kq_jax.topk_route_shed_pallas`) are imported on first use.
"""

from kq_core.contract import RouteShedResult, TopkRouteShedResult
from kq_jax.api import (
           default_impl,
           route_shed,
           route_shed_reference,
           topk_route_shed,
           topk_route_shed_reference,
)

__all__ = ["RouteShedResult", "TopkRouteShedResult", "default_impl", "route_shed", "route_shed_reference",
           "topk_route_shed", "topk_route_shed_reference"]
