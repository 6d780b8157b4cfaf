"""Greedy generation through the exact layer-by-layer loop, in JAX or through mlx-lm (``kq demo --rule exact``).

Each layer's misses are read before its experts run (:meth:`kq_host.residency.ResidencyManager.acquire`)
and, with look-ahead, the next layer's predicted experts are prefetched: the text is the model's with
every expert in memory, at any residency (:mod:`kq_jax.exact_loop`, :func:`kq_mlx.mlx_lm_adapter.attach_exact`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class ExactRun:
    """What one generation through the exact loop did (counted over the generated tokens' steps)."""

    slots: int
    tokens: list[int]
    hit_rate: float = 1.0
    critical_reads_per_token: float = 0.0
    prefetches_per_token: float = 0.0
    prefetch_used_per_token: float = 0.0
    prefetch_wasted_per_token: float = 0.0
    mib_per_token: float = 0.0
    memory_mib: float = 0.0
    token_seconds: list[float] = field(default_factory=list)


def generate_exact(framework: str, checkpoint, prompt_ids: list[int], tokens: int, residency: float,
                   policy: str = "lfu", *, lookahead: bool = True) -> ExactRun:
    """``tokens`` greedy tokens after ``prompt_ids`` through an arena of ``residency`` of each layer's experts.

    Args:
        framework: ``"jax"`` (:class:`kq_jax.exact_loop.ExactLoop`) or ``"mlx"`` (mlx-lm with
            :func:`kq_mlx.mlx_lm_adapter.attach_exact`); the prompt is fed one token at a time.
        checkpoint: a Qwen3-MoE checkpoint directory (float or mlx-community's quantized layout).

    Returns:
        :class:`ExactRun`, ``tokens`` the prompt and the generated ids.
    """
    from kq import study
    from kq_host.quantized import Quantization, open_experts
    from kq_host.residency import ResidencyManager

    if framework not in ("jax", "mlx"):
        raise ValueError(f"generate_exact: framework must be 'jax' or 'mlx', got {framework!r}")
    if not prompt_ids:
        raise ValueError("generate_exact: the prompt has no tokens")
    config = study.checkpoint_config(checkpoint, framework)
    layers, experts, top_k = config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]
    slots = max(top_k, round(residency * experts))
    quantized = Quantization.of(checkpoint) is not None
    # JAX's arena holds float experts; MLX's arena takes a quantized checkpoint's arrays as stored.
    with open_experts(checkpoint, ("gate_proj", "up_proj", "down_proj"), dequantized=framework == "jax") as store:
        arena, step = (_jax_loop if framework == "jax" else _mlx_loop)(checkpoint, slots, len(prompt_ids) + tokens,
                                                                     store, quantized)
        manager = ResidencyManager(layers, experts, slots, arena=arena, policy=policy,
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert),
                                   bytes_per_expert=store.expert_nbytes(0))
        for layer in range(layers):
            manager.preload(layer, range(slots))
        run = ExactRun(slots, list(prompt_ids), memory_mib=layers * slots * store.expert_nbytes(0) / 2**20)
        forward = step(manager, lookahead)
        for position in range(len(prompt_ids) + tokens - 1):
            if position == len(prompt_ids) - 1:
                _, before = manager.stats()
                ahead_before = manager.lookahead_stats()
            start = time.perf_counter()
            next_id = forward(run.tokens[position], position)
            manager.next_token()
            if position >= len(prompt_ids) - 1:
                run.tokens.append(next_id)
                run.token_seconds.append(time.perf_counter() - start)
        _, after = manager.stats()
        ahead = {name: int(value.sum() - ahead_before[name].sum()) for name, value in manager.lookahead_stats().items()
                 if name in ("critical_reads", "prefetches", "prefetch_used", "prefetch_wasted")}
        manager.close()
    since = after.since(before)
    run.hit_rate = since.hit_rate
    run.critical_reads_per_token = ahead["critical_reads"] / tokens
    run.prefetches_per_token = ahead["prefetches"] / tokens
    run.prefetch_used_per_token = ahead["prefetch_used"] / tokens
    run.prefetch_wasted_per_token = ahead["prefetch_wasted"] / tokens
    run.mib_per_token = since.bytes_read / tokens / 2**20
    return run


def _jax_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import jax.numpy as jnp

    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    cfg = qwen3_moe.Qwen3MoeConfig.load(checkpoint)
    params = qwen3_moe.load_params(checkpoint, cfg, experts=False)
    shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    arena = JaxArena(cfg.num_hidden_layers, slots, shapes)

    def step(manager, lookahead):
        loop = ExactLoop(params, cfg, manager, arena, length=length, lookahead=lookahead)
        return lambda token, position: int(jnp.argmax(loop.step(token, position)[0]))

    return arena, step


def _mlx_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, attach_exact

    model, _ = load(str(Path(checkpoint)), lazy=True)
    blocks = attach_arena(model, slots, keep_experts=False)
    if not mx.metal.is_available() and not quantized:
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
    cache = make_prompt_cache(model)

    def step(manager, lookahead):
        attach_exact(model, blocks, manager, lookahead=lookahead)

        def forward(token, position):
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            return int(mx.argmax(logits).item())

        return forward

    return SwitchGLUArena(blocks), step
