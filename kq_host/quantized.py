"""The quantized-checkpoint reader's former module: its names live in :mod:`kq_host.checkpoint`.

Importers still naming this module: ``kq_jax/qwen3_moe.py`` and ``kq/bench/jobs/{exact_loop,mlx_decode,
tier_decode}.py``; this module goes once they import from :mod:`kq_host.checkpoint`.
"""

from kq_host.checkpoint import DequantizedExperts, Quantization, dense_tensors, open_experts

__all__ = ["DequantizedExperts", "Quantization", "dense_tensors", "open_experts"]
