"""The fused Pallas kernels of ``route_shed`` and ``topk_route_shed`` (Triton lowering).

``config`` picks the launch, ``route_shed_kernel`` and ``topk_kernel`` hold
the kernels, ``ops`` launches them. Reached through ``kq_jax.route_shed(...,
impl="pallas")``, which checks the arguments; imported on first use.
"""

from kq_jax.pallas.config import (
           MAX_UNROLLED_K,
           KernelConfig,
           block_config,
           topk_block_config,
)
from kq_jax.pallas.ops import route_shed_pallas, topk_route_shed_pallas

__all__ = ["MAX_UNROLLED_K", "KernelConfig", "block_config", "route_shed_pallas", "topk_block_config",
           "topk_route_shed_pallas"]
