"""The low-precision tier of a checkpoint's experts under the mlx-lm arena's projection names."""

from __future__ import annotations

import json
from pathlib import Path

from kq_host.checkpoint import CHECKPOINT_LAYOUTS
from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE


def arena_tier(checkpoint, *, bits: int = DEFAULT_TIER_BITS, group_size: int = DEFAULT_TIER_GROUP_SIZE):
    """A ``qwen3_moe`` or ``mixtral`` checkpoint's low-precision tier of every expert, quantized from its
    float weights (dequantized where it is stored quantized), its projections under the mlx-lm arena's
    names (:func:`kq_mlx.mlx_lm_adapter.attach_tier`): built once, cached on disk
    (:func:`kq_host.tier.build_tier`); ``bits`` and ``group_size`` default to :data:`kq_host.tier.DEFAULT_TIER_BITS`
    and :data:`~kq_host.tier.DEFAULT_TIER_GROUP_SIZE`."""
    from kq_host.checkpoint import open_experts
    from kq_host.tier import Tier, build_tier
    from kq_mlx.mlx_lm_adapter import PROJECTIONS

    cfg = json.loads((Path(checkpoint) / "config.json").read_bytes())
    if cfg.get("model_type") not in CHECKPOINT_LAYOUTS:
        raise ValueError(f"arena_tier: {checkpoint}'s model_type is {cfg.get('model_type')!r}; known layouts: "
                         f"{sorted(CHECKPOINT_LAYOUTS)}")
    template, projections, experts_key = CHECKPOINT_LAYOUTS[cfg["model_type"]]
    with open_experts(checkpoint, projections, template=template) as floats:
        built = build_tier(floats, cfg["num_hidden_layers"], cfg[experts_key], bits=bits, group_size=group_size)
    return Tier({arena: built.weights[name] for arena, name in zip(PROJECTIONS, projections)}, built.bits,
                built.group_size)
